"""The server's own work on a streamed completion of token ids, on the CPU: from the ASGI call to the engine prompt,
and from the first output on the event loop to the first chunk sent.

    python scripts/server_request_cost.py [--ids 1000] [--requests 40]
The app (``vtcore.server.app.build_app``) over an ``AsyncLLM`` of the embedded default model is called in-process
with a prepared body (no socket, no client): each stage is stamped with ``time.perf_counter`` on entry (and some on
exit), and the medians over the requests (after five unmeasured ones) are printed in ms since the ASGI call. This
is the "parsed, validated, engine prompt built" hop of ``scripts/served_hops.py``, taken apart; and its "the server's
event loop has them -> the first chunk handed to uvicorn" hop: ``output on the loop`` (the engine's first output
handed to the request's stream, on the event loop) to ``headers sent`` and ``first chunk sent`` (the ASGI sends).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import time
from typing import Any

import fastapi.routing

from vtcore.engine import async_llm
from vtcore.engine.async_llm import AsyncLLM
from vtcore.server import gate, generation, json_body
from vtcore.server.app import build_app

STAMPS: list[tuple[str, float]] = []


def _wrap(owner: Any, name: str, label: str, exit_label: str | None = None) -> None:
    """Stamp ``owner.name``'s calls (none where an older vtcore, run for an A/B, lacks it)."""
    original = getattr(owner, name, None)
    if original is None:
        return
    if asyncio.iscoroutinefunction(original):
        async def wrapped(*args: Any, **kwargs: Any) -> Any:
            STAMPS.append((label, time.perf_counter()))
            try:
                return await original(*args, **kwargs)
            finally:
                if exit_label:
                    STAMPS.append((exit_label, time.perf_counter()))
    else:
        def wrapped(*args: Any, **kwargs: Any) -> Any:
            STAMPS.append((label, time.perf_counter()))
            try:
                return original(*args, **kwargs)
            finally:
                if exit_label:
                    STAMPS.append((exit_label, time.perf_counter()))
    setattr(owner, name, wrapped)


async def _one(app: Any, body: bytes) -> list[tuple[str, float]]:
    """One request through the app until its stream ends; its first stamp of each label, from the ASGI call."""
    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST", "scheme": "http",
             "path": "/v1/completions", "raw_path": b"/v1/completions", "query_string": b"", "root_path": "",
             "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())],
             "client": ("127.0.0.1", 1), "server": ("127.0.0.1", 2)}
    sent = False

    async def receive() -> dict[str, Any]:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        await asyncio.sleep(60)
        return {"type": "http.disconnect"}

    async def send(message: dict[str, Any]) -> None:
        if message["type"] == "http.response.start":
            if message["status"] != 200:
                raise RuntimeError(f"HTTP {message['status']}")
            STAMPS.append(("headers sent", time.perf_counter()))
        elif message.get("body"):
            STAMPS.append(("first chunk sent", time.perf_counter()))

    STAMPS.clear()
    start = time.perf_counter()
    await app(scope, receive, send)
    first: dict[str, float] = {}
    for label, t in STAMPS:
        first.setdefault(label, (t - start) * 1e3)
    return list(first.items())


async def _run(args: argparse.Namespace) -> None:
    engine = AsyncLLM(device="cpu")
    try:
        app = build_app(engine, "m", None, 1 << 24, None, None, None, False)
        _wrap(gate.Gate, "_handle", "gate")
        _wrap(json_body, "parse_body", "body parse", "body parsed")
        _wrap(fastapi.routing, "solve_dependencies", "validation (FastAPI)", "validated")
        _wrap(generation.GenerationEndpoint, "prepare", "prepare")
        _wrap(generation.EnginePrompt, "__init__", "engine prompt", "engine prompt built")
        _wrap(AsyncLLM, "_submit", "add submitted")
        _wrap(async_llm, "_put_all", "output on the loop")
        rng = random.Random(0)
        vocab = min(engine.limits().vocab_size, 1000)
        bodies = [json.dumps({"model": "m", "prompt": [rng.randrange(vocab) for _ in range(args.ids)],
                              "max_tokens": 1, "temperature": 0.0, "ignore_eos": True, "stream": True}).encode()
                  for _ in range(args.requests + 5)]
        rows = [await _one(app, b) for b in bodies]
    finally:
        engine.shutdown()
    rows = rows[5:]
    print(f"a streamed completion of {args.ids} ids, ms after the ASGI call (medians of {len(rows)}):")
    previous = 0.0
    for label, _ in rows[-1]:
        median = statistics.median(dict(r)[label] for r in rows if label in dict(r))
        print(f"  {label:<24} {median:7.3f}  (+{median - previous:.3f})")
        previous = median


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--ids", type=int, default=1000)
    ap.add_argument("--requests", type=int, default=40)
    args = ap.parse_args()
    asyncio.run(_run(args))


if __name__ == "__main__":
    main()
