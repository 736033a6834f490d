"""Where a served request's TTFT goes, hop by hop, across the client, the server and the engine core processes.

    python3 scripts/served_hops.py [--requests 24] [--input-len 1024] [--out DIR] -- SERVE_ARGS...
e.g. ``-- SHAPES/qwen3-0.6b --load-format dummy --dtype bfloat16`` (``vtcore serve``'s arguments; the engine
core runs in its own process, the default). This script starts ``vtcore serve`` as a child of its own (this
file again, ``--serve-role``), then sends streamed ``/v1/completions`` of random ids one at a time (concurrency 1,
the case issue 26's "TTFT within 1 ms of in-process" is about; ``--gap-ms`` apart) with the bench's HTTP client,
and stops it.

Every process stamps its hops with ``time.monotonic`` (one clock across the machine's processes): the server's
functions are wrapped here, and the engine core process, spawned from this file, imports it again and gets the
same wraps. Each request's hops are the first of each kind after the previous one, from the client's send:

    client send > http in (uvicorn reads the request) > arrival (the request parsed, validated, prompt built)
    > add queued (front end's pickled add) > add written (its sender thread) > core has add > add done
    > step in (first step after the add) > step out (the step whose outputs carry the first token)
    > outputs written (core's sender thread) > front end has outputs (its receiving thread)
    > loop delivers (the server's event loop) > body sent (the first chunk handed to uvicorn) > client first

Medians over the requests after the first two. Nothing here is a pass condition.
"""
from __future__ import annotations

import argparse
import atexit
import json
import os
import socket
import statistics
import subprocess
import sys
import time
from multiprocessing import connection as mp_connection
from typing import Any, Callable

STAMPS: list[tuple[str, float]] = []
HOPS = ("client send", "http in", "arrival", "add queued", "add written", "core has add", "add done", "step in",
        "step out", "outputs written", "front end has outputs", "loop delivers", "body sent", "client first")


def _stamp(label: str) -> None:
    STAMPS.append((label, time.monotonic()))


def _wrap(owner: Any, name: str, before: Callable[..., str | None] | None = None,
          after: Callable[..., str | None] | None = None) -> None:
    """Wrap ``owner.name``: ``before(*args)`` / ``after(result, *args)`` name the stamp to take (None: none)."""
    original = getattr(owner, name)

    def wrapped(*args: Any, **kwargs: Any) -> Any:
        if before is not None and (label := before(*args)):
            _stamp(label)
        result = original(*args, **kwargs)
        if after is not None and (label := after(result, *args)):
            _stamp(label)
        return result

    setattr(owner, name, wrapped)


def _kind(data: Any) -> bytes:
    """The message kind inside a pickled ``(kind, ...)`` tuple's first bytes."""
    head = bytes(memoryview(data)[:40])
    return next((k for k in (b"outputs", b"added", b"add") if k in head), b"")


def _install() -> None:
    """The wraps of both the server's and the engine core's processes (this module's import runs them)."""
    from vtcore.engine import async_llm, core_process
    from vtcore.engine.llm_engine import LLMEngine
    from vtcore.server import generation

    written = {b"add": "add written", b"outputs": "outputs written"}
    _wrap(mp_connection.Connection, "_send_bytes", before=lambda self, buf: written.get(_kind(buf)))
    for name in ("send", "sendall"):  # (the engine's ``_Sender`` writes its framed messages on the socket)
        _wrap(socket.socket, name, before=lambda self, buf, *_: written.get(_kind(buf)))
    _wrap(mp_connection.Connection, "recv", after=lambda msg, self: {"add": "core has add", "outputs": (
        "front end has outputs")}.get(msg[0]) if isinstance(msg, tuple) else None)
    _wrap(core_process.CoreClient, "send", before=lambda self, msg: "add queued" if msg[0] == "add" else None)
    _wrap(LLMEngine, "add_request", after=lambda *_: "add done")
    _wrap(LLMEngine, "step", before=lambda self: "step in",
          after=lambda outs, self: "step out" if any(o.outputs and o.outputs[0].token_ids for o in outs) else None)
    _wrap(async_llm, "_put_all", before=lambda items: "loop delivers")
    _wrap(generation.EnginePrompt, "__init__", after=lambda *_: "arrival")
    try:
        from uvicorn.protocols.http import h11_impl, httptools_impl
    except ImportError:  # (the core process of a machine without uvicorn: the server's wraps are not needed)
        return
    for impl in (httptools_impl, h11_impl):
        _wrap(impl.HttpToolsProtocol if impl is httptools_impl else impl.H11Protocol, "data_received",
              before=lambda self, data: "http in")
        original = impl.RequestResponseCycle.send

        async def send(self: Any, message: Any, _original: Any = original) -> None:
            if message.get("type") == "http.response.body" and message.get("body"):
                _stamp("body sent")
            await _original(self, message)

        impl.RequestResponseCycle.send = send


def _dump() -> None:
    folder = os.environ.get("SERVED_HOPS_DIR")
    if folder:
        with open(os.path.join(folder, f"stamps-{os.getpid()}.json"), "w") as f:
            json.dump(STAMPS, f)


if os.environ.get("SERVED_HOPS_DIR"):  # the server child and the core process it spawns
    _install()
    atexit.register(_dump)


def _requests(url: str, n: int, input_len: int, output_len: int, gap_s: float) -> list[tuple[float, float]]:
    """(send, first event) stamps of ``n`` streamed completions sent one at a time, ``gap_s`` apart."""
    import asyncio
    import random

    from vtcore.bench.http import served_model
    from vtcore.bench.http_stream import StreamingConnection

    model = served_model(url.rsplit("/", 1)[0])

    async def run() -> list[tuple[float, float]]:
        conn, rng, out = StreamingConnection(url), random.Random(0), []
        for _ in range(n):
            body = json.dumps({"model": model, "prompt": [rng.randrange(1000) for _ in range(input_len)],
                               "max_tokens": output_len, "temperature": 0.0, "ignore_eos": True,
                               "stream": True}).encode()
            sent, first = time.monotonic(), None
            async for data in conn.events(body):
                if first is None and data != b"[DONE]" and json.loads(data).get("choices"):
                    first = time.monotonic()
            out.append((sent, first))
            await asyncio.sleep(gap_s)
        conn.close()
        return out

    return asyncio.run(run())


def _hops(stamps: list[tuple[str, float]], sent: float, end: float) -> dict[str, float]:
    """Each hop's first stamp after the previous hop's, within [sent, end) (ms after ``sent``)."""
    times, at = {"client send": 0.0}, sent
    for hop in HOPS[1:-1]:
        t = next((t for label, t in stamps if label == hop and at <= t < end), None)
        if t is None:
            continue
        if hop == "step out":  # the last "step in" before it starts the step that gave the first token
            times["step in (the token's step)"] = (max(t_ for label, t_ in stamps if label == "step in"
                                                       and at <= t_ < t) - sent) * 1e3
        times[hop], at = (t - sent) * 1e3, t
    out = sent + times.get("step out", float("nan")) / 1e3  # (no step out: no step counted)
    times["steps"] = sum(1 for label, t in stamps if label == "step in" and sent <= t <= out)
    return times


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--requests", type=int, default=24)
    ap.add_argument("--input-len", type=int, default=1024)
    ap.add_argument("--output-len", type=int, default=4)
    ap.add_argument("--gap-ms", type=float, default=0.0,
                    help="the pause between a response's end and the next request (0: a closed loop, as the bench)")
    ap.add_argument("--port", type=int, default=8790)
    ap.add_argument("--out", default=None)
    ap.add_argument("--serve-role", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("serve_args", nargs="*")
    args = ap.parse_args()
    if args.serve_role:
        from vtcore.server.serve import main as serve_main
        sys.exit(serve_main(args.serve_args))
    import tempfile
    import urllib.request

    folder = tempfile.mkdtemp(prefix="served-hops-")
    server = subprocess.Popen([sys.executable, os.path.abspath(__file__), "--serve-role", "--", *args.serve_args,
                               "--port", str(args.port)], env={**os.environ, "SERVED_HOPS_DIR": folder})
    try:
        for _ in range(1200):
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{args.port}/health")
                break
            except OSError:
                if server.poll() is not None:
                    sys.exit(f"the server exited with {server.returncode}")
                time.sleep(0.5)
        client = _requests(f"http://127.0.0.1:{args.port}/v1/completions", args.requests, args.input_len,
                           args.output_len, args.gap_ms / 1e3)
    finally:
        server.send_signal(2)
        server.wait(timeout=120)
    stamps = sorted((tuple(s) for name in os.listdir(folder) for s in json.load(open(os.path.join(folder, name)))),
                    key=lambda s: s[1])
    rows = []
    for i, (sent, first) in enumerate(client):
        end = client[i + 1][0] if i + 1 < len(client) else float("inf")
        row = _hops(stamps, sent, end)
        row["client first"] = (first - sent) * 1e3
        rows.append(row)
    kept = rows[2:] or rows
    order = [h for h in (*HOPS[:8], "step in (the token's step)", *HOPS[8:]) if all(h in r for r in kept)]
    med = {h: statistics.median(r[h] for r in kept) for h in (*order, "steps")}
    print(f"served TTFT by hop, medians of {len(kept)} requests ({args.input_len}-token prompts), ms after the "
          f"client's send (and since the hop before); {med['steps']:.0f} step(s) to the first token:")
    prev = 0.0
    for h in order:
        print(f"  {h:<28} {med[h]:8.3f}  (+{med[h] - prev:.3f})")
        prev = med[h]
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, f"served-hops-{args.input_len}.json"), "w") as f:
            json.dump({"serve_args": args.serve_args, "median_ms": med, "requests": rows}, f, indent=1)


if __name__ == "__main__":
    main()
