"""``vtcore bench``: a closed-loop serving benchmark through ``AsyncLLM``.

For each concurrency ``c`` the benchmark keeps ``c`` requests in flight (random prompt token ids of
``--input-len``, ``max_tokens=--output-len``, ``ignore_eos=True``, greedy) until ``--num-prompts``
requests (default ``4*c``, at least ``c``) have completed. Every statistic comes from
``time.perf_counter`` timestamps taken on the caller's event loop as outputs arrive:

* TTFT: first output token arrival - request send;
* TPOT: (latency - TTFT) / (output tokens - 1);
* ITL: the gaps between successive arrivals of new tokens of one request;
* throughput: tokens / wall time, the wall time running from the first send to the last completion.

``steps`` is the number of engine steps (prefill, mixed and decode) taken during a concurrency's run;
``host_submit_ms_mean`` is the mean wall time the engine thread spent in ``ModelRunner.submit`` per step
(preparing the batch on the host and enqueueing its device work; waiting for results is not included).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import random
import time
from typing import Any, Sequence, TextIO

DEFAULT_CONCURRENCY = "1,2,4,8,16,32"
DEFAULT_INPUT_LEN = 1024
DEFAULT_OUTPUT_LEN = 128


def parse_concurrency(text: str) -> list[int]:
    """``"1,2,4"`` -> ``[1, 2, 4]``; anything but positive integers raises naming the bad value."""
    values = []
    for part in str(text).split(","):
        part = part.strip()
        try:
            v = int(part)
        except ValueError:
            v = None
        if v is None or v <= 0:
            raise argparse.ArgumentTypeError(
                f"--concurrency={text!r}: {part!r} is not a positive integer; expected a comma-separated "
                f"list such as 1,2,4")
        values.append(v)
    return values


def _positive_int(name: str):
    def parse(text: str) -> int:
        try:
            v = int(text)
        except ValueError:
            v = 0
        if v <= 0:
            raise argparse.ArgumentTypeError(f"{name}={text!r}: expected a positive integer")
        return v
    return parse


def add_bench_parser(sub: Any) -> argparse.ArgumentParser:
    """Add the ``bench`` subcommand to ``sub`` (the parser's subparsers)."""
    p = sub.add_parser("bench", help="closed-loop serving benchmark through AsyncLLM (TTFT, TPOT, ITL, throughput)")
    p.add_argument("--model", default=None, help="HF checkpoint folder (default: the embedded default model)")
    p.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--load-format", default="auto", choices=["auto", "dummy"],
                   help="dummy: random weights from config.json")
    p.add_argument("--max-model-len", type=_positive_int("--max-model-len"), default=None)
    p.add_argument("--concurrency", type=parse_concurrency, default=parse_concurrency(DEFAULT_CONCURRENCY),
                   help=f"requests kept in flight, comma-separated (default: {DEFAULT_CONCURRENCY})")
    p.add_argument("--input-len", type=_positive_int("--input-len"), default=None,
                   help=f"prompt tokens per request (default: {DEFAULT_INPUT_LEN}, clamped to fit max_model_len)")
    p.add_argument("--output-len", type=_positive_int("--output-len"), default=DEFAULT_OUTPUT_LEN)
    p.add_argument("--num-prompts", type=_positive_int("--num-prompts"), default=None,
                   help="requests completed per concurrency (default: 4*c; at least c)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=None, metavar="PATH", help="also write every number as JSON")
    p.add_argument("--no-progress", action="store_true", help="no tqdm progress bar")
    p.set_defaults(func=cmd_bench)
    return p


# ---------------------------------------------------------------------------------------- statistics
def _percentile(sorted_xs: list[float], q: float) -> float:
    """Linear-interpolated percentile (numpy's default) of an ascending list."""
    if len(sorted_xs) == 1:
        return sorted_xs[0]
    pos = (len(sorted_xs) - 1) * q / 100.0
    lo = int(pos)
    hi = min(lo + 1, len(sorted_xs) - 1)
    return sorted_xs[lo] + (sorted_xs[hi] - sorted_xs[lo]) * (pos - lo)


def summarize(xs: Sequence[float]) -> dict[str, float | None]:
    """mean, median, p90, p99 (seconds) of ``xs``; None each when there is nothing to summarize."""
    if not xs:
        return {"mean": None, "median": None, "p90": None, "p99": None, "count": 0}
    s = sorted(xs)
    return {"mean": sum(s) / len(s), "median": _percentile(s, 50), "p90": _percentile(s, 90),
            "p99": _percentile(s, 99), "count": len(s)}


# ---------------------------------------------------------------------------------------- the run
def resolve_lengths(max_model_len: int, input_len: int | None, output_len: int) -> tuple[int, bool]:
    """(input_len, clamped): the default input length is clamped to fit; an explicit one must fit."""
    if output_len >= max_model_len:
        raise ValueError(f"--output-len={output_len}: leaves no room for a prompt in max_model_len={max_model_len}")
    if input_len is None:
        fit = max_model_len - output_len
        return min(DEFAULT_INPUT_LEN, fit), DEFAULT_INPUT_LEN > fit
    if input_len + output_len > max_model_len:
        raise ValueError(f"--input-len={input_len} + --output-len={output_len} = {input_len + output_len} "
                         f"exceeds max_model_len={max_model_len}")
    return input_len, False


async def _one_request(engine: Any, rid: str, prompt_ids: list[int], params: Any) -> dict[str, Any]:
    arrivals: list[float] = []  # one timestamp per output carrying new tokens
    counts: list[int] = []      # how many new tokens each carried
    seen = 0
    finish_reason = None
    sent = time.perf_counter()
    async for out in engine.generate({"prompt_token_ids": prompt_ids}, params, request_id=rid):
        now = time.perf_counter()
        comp = out.outputs[0]
        n = len(comp.token_ids)
        if n > seen:
            arrivals.append(now)
            counts.append(n - seen)
            seen = n
        finish_reason = comp.finish_reason
    done = time.perf_counter()
    latency = done - sent
    ttft = arrivals[0] - sent if arrivals else None
    tpot = (latency - ttft) / (seen - 1) if ttft is not None and seen > 1 else None
    itl = [b - a for a, b in zip(arrivals, arrivals[1:])]
    return {"request_id": rid, "prompt_tokens": len(prompt_ids), "output_tokens": seen,
            "finish_reason": finish_reason, "send_time": sent, "done_time": done, "latency_s": latency,
            "ttft_s": ttft, "tpot_s": tpot, "itl_s": itl, "arrival_token_counts": counts}


class _SubmitTimer:
    """Times ``ModelRunner.submit`` on the engine thread (perf_counter), restored on exit."""

    def __init__(self, runner: Any) -> None:
        self.runner = runner
        self.total = 0.0
        self.calls = 0

    def __enter__(self) -> "_SubmitTimer":
        orig = self.runner.submit

        def timed(*a: Any, **k: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return orig(*a, **k)
            finally:
                self.total += time.perf_counter() - t0
                self.calls += 1

        self.runner.submit = timed
        return self

    def __exit__(self, *exc: Any) -> None:
        del self.runner.submit  # drop the instance attribute: the class method shows through again


async def _run_concurrency(engine: Any, c: int, num_prompts: int, input_len: int, output_len: int,
                           vocab_size: int, rng: random.Random, progress: bool) -> dict[str, Any]:
    import torch
    from tqdm import tqdm

    from vtcore.sampling_params import SamplingParams

    prompts = [[rng.randrange(vocab_size) for _ in range(input_len)] for _ in range(num_prompts)]
    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    inner = engine.engine
    cuda = inner.device.type == "cuda"
    if cuda:
        torch.cuda.synchronize(inner.device)
        torch.cuda.reset_peak_memory_stats(inner.device)
    next_index = 0
    results: list[dict[str, Any]] = []
    bar = tqdm(total=num_prompts, desc=f"bench c={c}", unit="req", disable=not progress)

    async def worker() -> None:
        nonlocal next_index
        while next_index < num_prompts:
            i = next_index
            next_index += 1
            results.append(await _one_request(engine, f"bench-c{c}-{i}", prompts[i], params))
            bar.update(1)

    steps0 = inner.runner._steps
    with _SubmitTimer(inner.runner) as timer:
        start = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(c)))
        end = time.perf_counter()
    steps = inner.runner._steps - steps0
    bar.close()
    results.sort(key=lambda r: int(r["request_id"].rsplit("-", 1)[1]))
    wall = end - start
    prompt_tokens = sum(r["prompt_tokens"] for r in results)
    output_tokens = sum(r["output_tokens"] for r in results)
    return {
        "concurrency": c, "num_prompts": num_prompts, "input_len": input_len, "output_len": output_len,
        "wall_s": wall, "start_time": start, "end_time": end,
        "prompt_tokens": prompt_tokens, "output_tokens": output_tokens,
        "total_throughput_tok_s": (prompt_tokens + output_tokens) / wall,
        "output_throughput_tok_s": output_tokens / wall,
        "request_throughput_req_s": len(results) / wall,
        "ttft_s": summarize([r["ttft_s"] for r in results if r["ttft_s"] is not None]),
        "tpot_s": summarize([r["tpot_s"] for r in results if r["tpot_s"] is not None]),
        "itl_s": summarize([g for r in results for g in r["itl_s"]]),
        "latency_s": summarize([r["latency_s"] for r in results]),
        "steps": steps,
        "host_submit_ms_mean": (timer.total / timer.calls * 1e3) if timer.calls else None,
        "peak_gpu_memory_bytes": int(torch.cuda.max_memory_allocated(inner.device)) if cuda else None,
        "requests": results,
    }


def run_bench(args: argparse.Namespace, progress: bool = True) -> dict[str, Any]:
    """Build the engine, run every concurrency, return every number (the --json document)."""
    from vtcore.config import DEFAULT_MODEL, HFConfig
    from vtcore.engine.async_llm import AsyncLLM
    from vtcore.sampling_params import SamplingParams

    model = args.model or DEFAULT_MODEL
    concurrency = args.concurrency
    if isinstance(concurrency, str):
        concurrency = parse_concurrency(concurrency)
    hf = HFConfig.from_path(model)
    max_model_len = args.max_model_len or int(hf.get("max_position_embeddings", 4096))
    input_len, clamped = resolve_lengths(max_model_len, args.input_len, args.output_len)
    engine = AsyncLLM(model, device=args.device, dtype=args.dtype, load_format=args.load_format,
                      seed=args.seed, max_model_len=max_model_len)
    inner = engine.engine
    rng = random.Random(args.seed)

    async def main() -> list[dict[str, Any]]:
        # warm-up: one short request, untimed, so the first measured request does not pay for lazy setup
        warm = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
        async for _ in engine.generate({"prompt_token_ids": [rng.randrange(inner.vocab_size)
                                                             for _ in range(min(input_len, 8))]},
                                       warm, request_id="bench-warmup"):
            pass
        runs = []
        for c in concurrency:
            n = max(args.num_prompts or 4 * c, c)
            runs.append(await _run_concurrency(engine, c, n, input_len, args.output_len, inner.vocab_size, rng,
                                               progress))
        return runs

    try:
        runs = asyncio.run(main())
    finally:
        engine.shutdown()
    return {
        "model": model, "device": str(inner.device), "dtype": str(inner.dtype).replace("torch.", ""),
        "load_format": args.load_format, "max_model_len": max_model_len, "input_len": input_len,
        "input_len_clamped": clamped, "output_len": args.output_len, "seed": args.seed,
        "async_depth": inner.depth, "timer": "time.perf_counter", "runs": runs,
    }


def _ms(x: float | None) -> str:
    return "-" if x is None else f"{x * 1e3:.2f}"


def format_table(doc: dict[str, Any]) -> str:
    head = (f"{'conc':>5} {'reqs':>5} {'wall s':>8} {'tok/s':>10} {'out tok/s':>10} "
            f"{'TTFT ms mean/med/p90/p99':>28} {'TPOT ms mean/med/p90/p99':>28} {'ITL ms mean/med/p90/p99':>28} "
            f"{'steps':>6} {'host ms':>8} {'peak MiB':>9}")
    lines = [f"model={doc['model']} device={doc['device']} dtype={doc['dtype']} input_len={doc['input_len']}"
             f"{' (clamped to fit max_model_len=' + str(doc['max_model_len']) + ')' if doc['input_len_clamped'] else ''}"
             f" output_len={doc['output_len']}", head]
    for r in doc["runs"]:
        def q(s: dict) -> str:
            return "/".join(_ms(s[k]) for k in ("mean", "median", "p90", "p99"))
        peak = r["peak_gpu_memory_bytes"]
        host = r["host_submit_ms_mean"]
        lines.append(f"{r['concurrency']:>5} {r['num_prompts']:>5} {r['wall_s']:>8.2f} "
                     f"{r['total_throughput_tok_s']:>10.1f} {r['output_throughput_tok_s']:>10.1f} "
                     f"{q(r['ttft_s']):>28} {q(r['tpot_s']):>28} {q(r['itl_s']):>28} {r['steps']:>6} "
                     f"{'-' if host is None else f'{host:.2f}':>8} "
                     f"{'-' if peak is None else f'{peak / 2**20:.1f}':>9}")
    return "\n".join(lines) + "\n"


def cmd_bench(args: argparse.Namespace, out: TextIO) -> int:
    doc = run_bench(args, progress=not getattr(args, "no_progress", False))
    out.write(format_table(doc))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(doc, f, indent=2)
            f.write("\n")
        out.write(f"wrote {args.json}\n")
    return 0
