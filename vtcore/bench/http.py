"""``vtcore bench --base-url URL``: the closed-loop benchmark over OpenAI streaming HTTP, against any
OpenAI-compatible server (``vtcore serve``, vLLM, SGLang).

Each request is a streamed ``/v1/completions`` of ``--input-len`` random token ids (below
``PROMPT_ID_BOUND``, a vocabulary every served model has), ``max_tokens=--output-len``, greedy,
``ignore_eos`` (vLLM's extension) and ``stream_options.include_usage``; with ``--structured-share``, that
share of them (interleaved) also carry vLLM's ``structured_outputs: {"json": ...}`` with the bench's schema
(``vtcore.bench.structured_share``), and each run reports the two groups apart. Timestamps are taken as each
server-sent event arrives (``time.perf_counter``, from the moment the request's encoded body starts out: the
client's JSON encoding of its ids, ``scripts/json_body_cost.py``, is not the server's time): TTFT is the
first event with a choice (new tokens), ITL the gaps between such events, TPOT ``(latency - TTFT) /
(completion_tokens - 1)`` with the token count from the final usage chunk (an event may carry several
tokens). The statistics have the in-process bench's names, so the two compare field by field. The client is
``vtcore.bench.http_stream`` (plain HTTP/1.1 over asyncio, one kept-alive connection a stream). A
concurrency is driven by several client processes (``client_processes``; ``--client-processes``), started
together on a barrier, their requests merged: one process parsing every stream's events would measure itself.
"""
from __future__ import annotations

import asyncio
import json
import os
import random
import time
from typing import Any, Optional, Sequence

from vtcore.bench.http_stream import StreamingConnection, plain_http
from vtcore.bench.structured_share import bench_schema, constrained_flags, format_groups, groups
from vtcore.bench.summary import requests_per_concurrency, summarize

PROMPT_ID_BOUND = 1000


#: a request of the closed loop: its prompt's token ids, and the JSON schema it is held to (or None)
Prompt = tuple[list[int], Optional[dict[str, Any]]]


async def _one(connection: StreamingConnection, model: str, prompt: list[int], output_len: int,
               schema: dict[str, Any] | None = None) -> dict[str, Any]:
    """One streamed request; ``schema``: held to it (vLLM's ``structured_outputs``)."""
    body = {"model": model, "prompt": prompt, "max_tokens": output_len, "temperature": 0.0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}
    if schema is not None:
        body["structured_outputs"] = {"json": schema}
    payload = json.dumps(body).encode()  # before the clock: the client's encoding is not the server's time
    arrivals: list[float] = []
    tokens = cached = None
    finish = None
    sent = time.perf_counter()
    async for data in connection.events(payload):
        if data == b"[DONE]":
            continue
        now = time.perf_counter()
        event = json.loads(data)
        choices = event.get("choices") or []
        if choices:  # a chunk of new tokens (its text may be empty: a model served without a tokenizer)
            arrivals.append(now)
        for choice in choices:
            finish = choice.get("finish_reason") or finish
        if event.get("usage"):
            tokens = event["usage"].get("completion_tokens")
            cached = (event["usage"].get("prompt_tokens_details") or {}).get("cached_tokens")
    done = time.perf_counter()
    ttft = arrivals[0] - sent if arrivals else None
    latency = done - sent
    tpot = (latency - ttft) / (tokens - 1) if ttft is not None and tokens and tokens > 1 else None
    return {"prompt_tokens": len(prompt), "cached_tokens": cached, "output_tokens": tokens, "finish_reason": finish,
            "latency_s": latency,
            "constrained": schema is not None, "ttft_s": ttft, "tpot_s": tpot,
            "itl_s": [b - a for a, b in zip(arrivals, arrivals[1:])]}


#: streams one client process drives: parsing server-sent events in Python caps one process near 3,000
#: events a second (docs/BENCHMARKS.md: 4 processes at concurrency 128 measured the client, 12 the
#: server), so a process takes few enough streams to stay near half that at a 5 ms step
STREAMS_PER_PROCESS = 8
#: cores the client processes leave to the server under test on the same machine (its HTTP front end and
#: event loop, the engine core process and their threads): 16 client processes on a 16-core machine
#: measured 0.67-0.69x of in-process at concurrency 128 where 12 had measured 1.06x, other changes between
#: them (docs/BENCHMARKS.md; not yet compared in one run)
SERVER_CORES = 4


def client_processes(concurrency: int, asked: int | None = None) -> int:
    """Client processes for a concurrency: ``asked``, else one per ``STREAMS_PER_PROCESS`` streams, on at most
    the machine's cores less ``SERVER_CORES``; never more than the concurrency."""
    n = asked or min(-(-concurrency // STREAMS_PER_PROCESS), (os.cpu_count() or 1) - SERVER_CORES)
    return max(1, min(n, concurrency))


async def _closed_loop(base_url: str, model: str, c: int, prompts: list[Prompt], output_len: int,
                       warm_up: bool = True, start: Any = None) -> tuple[list[dict[str, Any]], float, float, float]:
    """``c`` streams over ``prompts`` (each takes the next one not yet sent), each on a connection of its own
    (``StreamingConnection``); after an untimed request on each (connection set-up; with constrained prompts,
    the first and every second one constrained: the server compiles the schema then) unless not ``warm_up``,
    and ``start`` (a barrier across processes) when given. Returns
    the requests' results, the loop's start and end (``time.perf_counter``, one clock for every process of
    the machine) and the CPU seconds this process took meanwhile."""
    url = base_url.rstrip("/") + "/completions"
    results: list[dict[str, Any]] = []
    connections = [StreamingConnection(url) for _ in range(c)]  # one a stream, kept alive
    try:
        if warm_up:  # every connection opened before the clock starts
            schema = next((schema for _, schema in prompts if schema is not None), None)
            await asyncio.gather(*(_one(connection, model, prompts[0][0][:8], 2, None if i % 2 else schema)
                                   for i, connection in enumerate(connections)))
        if start is not None:
            await asyncio.get_running_loop().run_in_executor(None, start.wait)
        next_index = 0

        async def worker(connection: StreamingConnection) -> None:
            nonlocal next_index
            while next_index < len(prompts):
                i = next_index
                next_index += 1
                ids, schema = prompts[i]
                results.append(await _one(connection, model, ids, output_len, schema))

        begin, cpu = time.perf_counter(), time.process_time()
        await asyncio.gather(*(worker(connection) for connection in connections))
        end, cpu = time.perf_counter(), time.process_time() - cpu
    finally:
        for connection in connections:
            connection.close()
    return results, begin, end, cpu


def _client_process(args: tuple) -> tuple[list[dict[str, Any]], float, float, float]:
    *loop_args, start = args
    return asyncio.run(_closed_loop(*loop_args, start=start))


def _concurrency(base_url: str, model: str, c: int, num_prompts: int, input_len: int, output_len: int,
                 rng: random.Random, processes: int, warm_up: bool, share: float, schema_len: int,
                 prefix_len: int = 0) -> dict[str, Any]:
    schema = bench_schema(schema_len)
    prefix = [rng.randrange(PROMPT_ID_BOUND) for _ in range(prefix_len)]
    prompts = [(prefix + [rng.randrange(PROMPT_ID_BOUND) for _ in range(input_len)], schema if held else None)
               for held in constrained_flags(num_prompts, share)]
    if processes == 1:
        parts = [asyncio.run(_closed_loop(base_url, model, c, prompts, output_len, warm_up))]
    else:  # process p: every processes-th prompt from the p-th, and its share of the streams
        import multiprocessing

        ctx = multiprocessing.get_context("spawn")  # the caller may run threads (a server under test)
        with ctx.Manager() as manager, ctx.Pool(processes) as pool:
            start = manager.Barrier(processes)
            parts = pool.map(_client_process, [(base_url, model, c // processes + (p < c % processes),
                                                prompts[p::processes], output_len, warm_up, start)
                                               for p in range(processes)])
    results = [r for part in parts for r in part[0]]
    begin, end = min(p[1] for p in parts), max(p[2] for p in parts)
    wall = end - begin
    prompt_tokens = sum(r["prompt_tokens"] for r in results)
    output_tokens = sum(r["output_tokens"] or 0 for r in results)
    free = [r for r in results if not r["constrained"]]  # (a grammar may end its request early)
    reported = [r["cached_tokens"] for r in results if r["cached_tokens"] is not None]
    return {"concurrency": c, "num_prompts": num_prompts, "input_len": input_len, "output_len": output_len,
            "prefix_len": prefix_len, "client_processes": processes,
            # (the share of prompt tokens the server's usage says came from its prefix cache: vLLM's hit rate;
            # None where a response reported none)
            "prefix_cache_hit_rate": sum(reported) / prompt_tokens if len(reported) == len(results) and prompt_tokens
            else None,
            "wall_s": wall, "prompt_tokens": prompt_tokens, "output_tokens": output_tokens,
            # what the unconstrained requests asked for (max_tokens with ignore_eos) and got: a server that stops
            # early, or sends no usage, is measured on fewer tokens than the table's lengths say (``format_http``)
            "asked_output_tokens": len(free) * output_len,
            "unconstrained_output_tokens": sum(r["output_tokens"] or 0 for r in free),
            "total_throughput_tok_s": (prompt_tokens + output_tokens) / wall,
            "output_throughput_tok_s": output_tokens / wall, "request_throughput_req_s": len(results) / wall,
            "ttft_s": summarize([r["ttft_s"] for r in results if r["ttft_s"] is not None]),
            "tpot_s": summarize([r["tpot_s"] for r in results if r["tpot_s"] is not None]),
            "itl_s": summarize([g for r in results for g in r["itl_s"]]),
            "latency_s": summarize([r["latency_s"] for r in results]),
            "finish_reasons": sorted({str(r["finish_reason"]) for r in results}),
            # each client process's CPU seconds over its loop's wall seconds (one near 1.0 is the bottleneck)
            "client_cpu": [p[3] / (p[2] - p[1]) for p in parts],
            "structured_share": share, "groups": groups(results, wall, share)}


def served_model(base_url: str) -> str:
    """The first model ``GET /models`` lists (what the server serves)."""
    import httpx

    try:
        r = httpx.get(base_url.rstrip("/") + "/models", timeout=30.0)
        r.raise_for_status()
    except httpx.HTTPError as exc:  # OSError: the CLI reports it as an error line, not a traceback
        raise ConnectionError(f"--base-url {base_url}: GET /models failed ({type(exc).__name__}: {exc}); expected "
                              "an OpenAI-compatible server's /v1 URL, e.g. http://127.0.0.1:8000/v1") from None
    data = r.json().get("data") or []
    if not data:
        raise RuntimeError(f"GET {base_url}/models lists no model")
    return data[0]["id"]


def run_http(base_url: str, concurrency: Sequence[int], num_prompts: int | None, input_len: int, output_len: int,
             seed: int, model: str | None = None, processes: int | None = None, warm_up: bool = True,
             structured_share: float = 0.0, schema_len: int | None = None, prefix_len: int = 0) -> dict[str, Any]:
    """Every concurrency against ``base_url`` (ending in ``/v1``), each over ``client_processes(c,
    processes)`` client processes, each stream's connection first sending an untimed request unless not
    ``warm_up``; ``structured_share`` of the requests held to ``bench_schema(schema_len)`` (default
    ``output_len``: a warm-up of short requests compiles the timed run's schema); every prompt after one shared
    prefix of ``prefix_len`` random ids (as the in-process bench's ``--prefix-len``); the --json document."""
    plain_http(base_url)
    model = model or served_model(base_url)
    rng = random.Random(seed)
    runs = [_concurrency(base_url, model, c, requests_per_concurrency(c, num_prompts), input_len, output_len, rng,
                         client_processes(c, processes), warm_up, structured_share, schema_len or output_len,
                         prefix_len)
            for c in concurrency]
    return {"mode": "http", "base_url": base_url, "model": model, "input_len": input_len, "output_len": output_len,
            "seed": seed, "timer": "time.perf_counter", "runs": runs}


def format_http(doc: dict[str, Any]) -> str:
    def ms(s: dict[str, Any]) -> str:
        return "/".join("-" if s.get(k) is None else f"{s[k] * 1e3:.2f}" for k in ("mean", "median", "p90", "p99"))

    lines = [f"served: {doc['base_url']} model={doc['model']} input_len={doc['input_len']} "
             f"output_len={doc['output_len']} (OpenAI streaming /completions)",
             " conc  reqs   wall s  out tok/s  TTFT ms mean/med/p90/p99  TPOT ms mean/med/p90/p99  "
             "ITL ms mean/med/p90/p99  clients  hit %"]
    for r in doc["runs"]:
        rate = r.get("prefix_cache_hit_rate")
        lines.append(f"{r['concurrency']:>5} {r['num_prompts']:>5} {r['wall_s']:>8.2f} "
                     f"{r['output_throughput_tok_s']:>10.1f}  {ms(r['ttft_s'])}  {ms(r['tpot_s'])}  {ms(r['itl_s'])}  "
                     f"{r['client_processes']:>7}  {'-' if rate is None else f'{100 * rate:.1f}':>5}")
    for r in doc["runs"]:
        lines += format_groups(r)
    for r in doc["runs"]:
        if r["unconstrained_output_tokens"] != r["asked_output_tokens"]:
            lines.append(f"WARNING: concurrency {r['concurrency']}: the server returned "
                         f"{r['unconstrained_output_tokens']} output tokens of the {r['asked_output_tokens']} asked "
                         f"(finish reasons {', '.join(r['finish_reasons'])}): it ended requests before max_tokens "
                         "despite ignore_eos, or sent no usage (stream_options.include_usage); the rates above count "
                         "what it returned")
    return "\n".join(lines) + "\n"
