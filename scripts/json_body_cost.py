"""What a served request of token ids costs on the host before the engine sees it, per step of the way
(docs/BENCHMARKS.md): the client's JSON encoding of the body, the server's parsing of it (the standard
library's ``json``, orjson, and ``vtcore.server.json_body.parse_body``, the server's own read: orjson after a
scan for long number literals) and the protocol's validation; and on the way back, a streamed token's event
(``vtcore.server.sse.sse`` of a completion chunk, to the bytes the stream sends).

    python scripts/json_body_cost.py [--ids 1024] [--repeats 2000]
Medians of ``--repeats`` calls each, in microseconds, on a body of ``--ids`` random ids below 150,000.
"""
from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from typing import Any, Callable

import orjson

from vtcore.server.json_body import parse_body
from vtcore.server.protocol import CompletionRequest
from vtcore.server.sse import sse


def _median_us(fn: Callable[[], Any], repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e6


#: a streamed completion's chunk of one token, as the server sends one
CHUNK = {"id": "cmpl-6f1c2a9e7b3d4c5e8f90123456789abc-0", "object": "text_completion", "created": 1765000000,
         "model": "m", "choices": [{"index": 0, "text": " the", "logprobs": None, "finish_reason": None,
                                    "stop_reason": None}]}


def _as_bytes(event: str | bytes) -> bytes:
    """An event as the stream sends it (a base vtcore's ``sse`` gives ``str``, encoded by its stream)."""
    return event if isinstance(event, bytes) else event.encode()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--ids", type=int, default=1024)
    ap.add_argument("--repeats", type=int, default=2000)
    args = ap.parse_args()
    rng = random.Random(0)
    body = {"model": "m", "prompt": [rng.randrange(150_000) for _ in range(args.ids)], "max_tokens": 128,
            "stream": True, "ignore_eos": True}
    raw = json.dumps(body).encode()
    parsed = json.loads(raw)
    rows = {"json.dumps (the client)": lambda: json.dumps(body).encode(),
            "json.loads": lambda: json.loads(raw), "orjson.loads": lambda: orjson.loads(raw),
            "json_body.parse_body (server)": lambda: parse_body(raw),
            "CompletionRequest validation": lambda: CompletionRequest.model_validate(parsed)}
    for name, fn in rows.items():
        print(f"{name:30s} {_median_us(fn, args.repeats):8.1f} us ({args.ids} ids, {len(raw)} bytes)")
    print(f"{'sse of a token chunk':30s} {_median_us(lambda: _as_bytes(sse(CHUNK)), args.repeats):8.1f} us")


if __name__ == "__main__":
    main()
