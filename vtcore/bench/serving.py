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

Also measured in the same run:

* ``roofline`` (always): the device copy bandwidth, measured before the engine is built, and per
  concurrency the bytes one decode step must move (parameters + KV read) with ``roofline_ms`` and
  ``TPOT / roofline``; see :mod:`vtcore.bench.roofline`.
* ``peer`` (``--peer hf``): HF transformers' ``generate`` at batch 1 on the first ``min(num_prompts, 4)``
  prompts of the concurrency-1 run, after the engine is shut down; its TPOT, tokens/s and
  ``tpot_ratio = vtcore_tpot_s / hf_tpot_s``, where ``vtcore_tpot_s`` is the mean TPOT of vtcore's
  concurrency-1 requests on those same prompts; see :mod:`vtcore.bench.peer`.
* ``--offline`` replaces the serving sweep with nano-vllm's benchmark shape: ``--num-prompts``
  (default 256) requests with input and output lengths drawn uniformly (seeded) from
  ``--offline-min-len..--offline-max-len`` (default 100..1024; the upper bound clamped to
  ``max_model_len // 2`` so every request fits), submitted at once through ``LLM.generate``
  (greedy, ``ignore_eos``); total time is the ``generate`` call's wall time, output tokens are
  counted from the returned outputs.
"""
from __future__ import annotations

import argparse
import asyncio
import gc
import json
import random
import time
from typing import Any, Sequence, TextIO

from vtcore.bench.peer import PEER_CHOICES
from vtcore.bench.roofline import DEFAULT_COPY_MIB

DEFAULT_CONCURRENCY = "1,2,4,8,16,32"
DEFAULT_INPUT_LEN = 1024
DEFAULT_OUTPUT_LEN = 128
DEFAULT_OFFLINE_PROMPTS = 256
DEFAULT_OFFLINE_MIN_LEN, DEFAULT_OFFLINE_MAX_LEN = 100, 1024
PEER_PROMPTS = 4


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
    p.add_argument("--peer", default=None, choices=list(PEER_CHOICES),
                   help="hf: also time HF transformers' generate at batch 1 on the same prompts (needs "
                        "concurrency 1 for the TPOT ratio; skipped with --load-format dummy)")
    p.add_argument("--copy-mib", type=_positive_int("--copy-mib"), default=DEFAULT_COPY_MIB,
                   help=f"size of the tensor copied to measure device bandwidth (default: {DEFAULT_COPY_MIB})")
    p.add_argument("--offline", action="store_true",
                   help="instead of the serving sweep: nano-vllm's offline benchmark through LLM.generate "
                        f"(--num-prompts, default {DEFAULT_OFFLINE_PROMPTS}, random lengths, all at once)")
    p.add_argument("--offline-min-len", type=_positive_int("--offline-min-len"), default=DEFAULT_OFFLINE_MIN_LEN)
    p.add_argument("--offline-max-len", type=_positive_int("--offline-max-len"), default=DEFAULT_OFFLINE_MAX_LEN)
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
        "_prompts": prompts,  # popped by run_bench (the HF peer reuses the concurrency-1 prompts)
    }


def resolve_offline_lengths(max_model_len: int, lo: int, hi: int) -> tuple[int, int, bool]:
    """(lo, hi, clamped): ``hi`` clamped to ``max_model_len // 2`` so input + output always fits."""
    if lo > hi:
        raise ValueError(f"--offline-min-len={lo} exceeds --offline-max-len={hi}")
    cap = max_model_len // 2
    if cap < 1:
        raise ValueError(f"max_model_len={max_model_len}: too small for the offline benchmark")
    new_hi = min(hi, cap)
    new_lo = min(lo, new_hi)
    return new_lo, new_hi, (new_lo, new_hi) != (lo, hi)


def run_offline(args: argparse.Namespace, model: str, max_model_len: int) -> dict[str, Any]:
    """nano-vllm's benchmark: every request submitted at once through ``LLM.generate``; see the module doc."""
    from vtcore.engine.llm import LLM
    from vtcore.sampling_params import SamplingParams

    lo, hi, clamped = resolve_offline_lengths(max_model_len, args.offline_min_len, args.offline_max_len)
    n = args.num_prompts or DEFAULT_OFFLINE_PROMPTS
    llm = LLM(model, device=args.device, dtype=args.dtype, load_format=args.load_format, seed=args.seed,
              max_model_len=max_model_len)
    inner = llm.engine
    rng = random.Random(args.seed)
    prompts = [{"prompt_token_ids": [rng.randrange(inner.vocab_size) for _ in range(rng.randint(lo, hi))]}
               for _ in range(n)]
    params = [SamplingParams(temperature=0.0, max_tokens=rng.randint(lo, hi), ignore_eos=True) for _ in range(n)]
    llm.generate([{"prompt_token_ids": [1, 2, 3, 4]}], SamplingParams(temperature=0.0, max_tokens=2,
                                                                        ignore_eos=True))  # warm-up, untimed
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=not getattr(args, "no_progress", False))
    wall = time.perf_counter() - start
    output_tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    prompt_tokens = sum(len(p["prompt_token_ids"]) for p in prompts)
    return {
        "device": str(inner.device), "dtype": str(inner.dtype).replace("torch.", ""),
        "offline": {
            "num_prompts": n, "min_len": lo, "max_len": hi, "lengths_clamped": clamped,
            "requested_min_len": args.offline_min_len, "requested_max_len": args.offline_max_len,
            "prompt_tokens": prompt_tokens, "requested_output_tokens": sum(p.max_tokens for p in params),
            "output_tokens": output_tokens,
            "finish_reasons": sorted({o.outputs[0].finish_reason for o in outs}),
            "wall_s": wall, "output_throughput_tok_s": output_tokens / wall,
            "total_throughput_tok_s": (prompt_tokens + output_tokens) / wall,
        },
    }


def run_bench(args: argparse.Namespace, progress: bool = True) -> dict[str, Any]:
    """Build the engine, run every concurrency, return every number (the --json document)."""
    from vtcore.bench.roofline import (decode_step_bytes, kv_bytes_per_token, measure_copy_bandwidth,
                                       parameter_bytes, roofline_for_run)
    from vtcore.config import DEFAULT_MODEL, HFConfig
    from vtcore.engine.async_llm import AsyncLLM
    from vtcore.engine.llm_engine import resolve_device
    from vtcore.sampling_params import SamplingParams

    model = args.model or DEFAULT_MODEL
    peer = getattr(args, "peer", None)
    hf = HFConfig.from_path(model)
    max_model_len = args.max_model_len or int(hf.get("max_position_embeddings", 4096))
    if getattr(args, "offline", False):
        if peer:
            raise ValueError("--peer compares against the serving run at concurrency 1; it does not apply "
                             "with --offline")
        doc = run_offline(args, model, max_model_len)
        return {"model": model, "mode": "offline", "device": doc["device"], "dtype": doc["dtype"],
                "load_format": args.load_format, "max_model_len": max_model_len, "seed": args.seed,
                "timer": "time.perf_counter", "runs": [], "offline": doc["offline"]}
    concurrency = args.concurrency
    if isinstance(concurrency, str):
        concurrency = parse_concurrency(concurrency)
    input_len, clamped = resolve_lengths(max_model_len, args.input_len, args.output_len)
    # measured before the engine exists, so its buffers never compete with the KV cache for memory
    copy = measure_copy_bandwidth(resolve_device(args.device), getattr(args, "copy_mib", DEFAULT_COPY_MIB))
    engine = AsyncLLM(model, device=args.device, dtype=args.dtype, load_format=args.load_format,
                      seed=args.seed, max_model_len=max_model_len)
    inner = engine.engine
    rng = random.Random(args.seed)
    param_bytes = parameter_bytes(inner.runner.model)
    kv_per_token = kv_bytes_per_token(inner.runner.attention_layers, inner.dtype)
    device, dtype, vocab_size = inner.device, inner.dtype, inner.vocab_size

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
    prompts_c1 = None
    for r in runs:
        prompts = r.pop("_prompts")
        if r["concurrency"] == 1 and prompts_c1 is None:
            prompts_c1 = prompts
        step = decode_step_bytes(param_bytes, kv_per_token, r["concurrency"], input_len, args.output_len)
        r["roofline"] = roofline_for_run(step, copy["bandwidth_bytes_s"], r["tpot_s"]["mean"])
    doc = {
        "model": model, "mode": "serving", "device": str(device), "dtype": str(dtype).replace("torch.", ""),
        "load_format": args.load_format, "max_model_len": max_model_len, "input_len": input_len,
        "input_len_clamped": clamped, "output_len": args.output_len, "seed": args.seed,
        "async_depth": inner.depth, "timer": "time.perf_counter", "runs": runs,
        "roofline": {"param_bytes": param_bytes, "kv_bytes_per_token": kv_per_token,
                     "kv_context_tokens_per_seq": input_len + args.output_len / 2,
                     "copy_bandwidth_bytes_s": copy["bandwidth_bytes_s"], "copy": copy},
    }
    if peer:
        pad = hf.get("pad_token_id", None)
        del engine, inner  # free vtcore's weights and KV cache before HF loads its copy
        gc.collect()
        if device.type == "cuda":
            import torch
            torch.cuda.empty_cache()
        doc["peer"] = _peer_section(peer, model, device, dtype, args, runs, prompts_c1, input_len, vocab_size,
                                    rng, pad)
    return doc


def _peer_section(peer: str, model: str, device: Any, dtype: Any, args: argparse.Namespace,
                  runs: list[dict[str, Any]], prompts_c1: list[list[int]] | None, input_len: int,
                  vocab_size: int, rng: random.Random, pad: int | None) -> dict[str, Any]:
    from vtcore.bench.peer import run_hf_peer, skip_reason

    section: dict[str, Any] = {"name": peer, "skipped": False, "skip_reason": None}
    reason = skip_reason(args.load_format, args.output_len)
    if reason:
        return {**section, "skipped": True, "skip_reason": reason}
    c1 = next((r for r in runs if r["concurrency"] == 1), None)
    if c1 is not None:
        k = min(c1["num_prompts"], PEER_PROMPTS)
        prompts = prompts_c1[:k]
        tpots = [r["tpot_s"] for r in c1["requests"][:k]]
        vtcore_tpot = sum(tpots) / len(tpots)
        ratio_note = None
    else:  # no concurrency-1 run to compare with: HF still measured, on fresh prompts, no ratio
        k = min(args.num_prompts or PEER_PROMPTS, PEER_PROMPTS)
        prompts = [[rng.randrange(vocab_size) for _ in range(input_len)] for _ in range(k)]
        vtcore_tpot = None
        ratio_note = "no concurrency-1 run in --concurrency: no vtcore TPOT to compare"
    hf_doc = run_hf_peer(model, device, dtype, prompts, args.output_len, pad_token_id=pad)
    hf_tpot = hf_doc["tpot_s"]
    return {**section, "hf": hf_doc, "num_prompts": k, "same_prompts_as_concurrency_1": c1 is not None,
            "vtcore_tpot_s": vtcore_tpot, "hf_tpot_s": hf_tpot,
            "tpot_ratio": (vtcore_tpot / hf_tpot) if vtcore_tpot is not None and hf_tpot > 0 else None,
            "tpot_ratio_note": ratio_note}


def _ms(x: float | None) -> str:
    return "-" if x is None else f"{x * 1e3:.2f}"


def _gb(x: float) -> str:
    return f"{x / 1e9:.2f}"


def format_table(doc: dict[str, Any]) -> str:
    """The serving rows (one per concurrency), then, after a blank line, the roofline and peer sections.

    In ``--offline`` mode: one header line and the offline summary.
    """
    if doc.get("mode") == "offline":
        o = doc["offline"]
        return (f"model={doc['model']} device={doc['device']} dtype={doc['dtype']} offline: {o['num_prompts']} "
                f"requests, input/output lengths uniform in {o['min_len']}..{o['max_len']}"
                f"{' (clamped to fit max_model_len=' + str(doc['max_model_len']) + ')' if o['lengths_clamped'] else ''}\n"
                f"offline: prompt tokens {o['prompt_tokens']}, output tokens {o['output_tokens']}, "
                f"time {o['wall_s']:.2f} s, output {o['output_throughput_tok_s']:.1f} tok/s, "
                f"total {o['total_throughput_tok_s']:.1f} tok/s\n")
    head = (f"{'conc':>5} {'reqs':>5} {'wall s':>8} {'tok/s':>10} {'out tok/s':>10} "
            f"{'TTFT ms mean/med/p90/p99':>28} {'TPOT ms mean/med/p90/p99':>28} {'ITL ms mean/med/p90/p99':>28} "
            f"{'steps':>6} {'host ms':>8} {'peak MiB':>9} {'roof ms':>8} {'TPOT/roof':>9}")
    lines = [f"model={doc['model']} device={doc['device']} dtype={doc['dtype']} input_len={doc['input_len']}"
             f"{' (clamped to fit max_model_len=' + str(doc['max_model_len']) + ')' if doc['input_len_clamped'] else ''}"
             f" output_len={doc['output_len']}", head]
    for r in doc["runs"]:
        def q(s: dict) -> str:
            return "/".join(_ms(s[k]) for k in ("mean", "median", "p90", "p99"))
        peak = r["peak_gpu_memory_bytes"]
        host = r["host_submit_ms_mean"]
        roof = r["roofline"]
        ratio = roof["tpot_over_roofline"]
        lines.append(f"{r['concurrency']:>5} {r['num_prompts']:>5} {r['wall_s']:>8.2f} "
                     f"{r['total_throughput_tok_s']:>10.1f} {r['output_throughput_tok_s']:>10.1f} "
                     f"{q(r['ttft_s']):>28} {q(r['tpot_s']):>28} {q(r['itl_s']):>28} {r['steps']:>6} "
                     f"{'-' if host is None else f'{host:.2f}':>8} "
                     f"{'-' if peak is None else f'{peak / 2**20:.1f}':>9} "
                     f"{roof['roofline_ms']:>8.3f} {'-' if ratio is None else f'{ratio:.1f}':>9}")
    rl = doc["roofline"]
    lines += ["", f"roofline: copy bandwidth {_gb(rl['copy_bandwidth_bytes_s'])} GB/s (read+write of "
                  f"{rl['copy']['nbytes'] / 2**20:.0f} MiB, median of {len(rl['copy']['times_s'])} copies); "
                  f"params {rl['param_bytes'] / 1e6:.2f} MB; KV {rl['kv_bytes_per_token']} B/token x "
                  f"{rl['kv_context_tokens_per_seq']:g} tokens/seq; TPOT/roof uses the mean TPOT"]
    peer = doc.get("peer")
    if peer:
        if peer["skipped"]:
            lines.append(f"peer {peer['name']}: skipped: {peer['skip_reason']}")
        else:
            h = peer["hf"]
            ratio = peer["tpot_ratio"]
            vt = peer["vtcore_tpot_s"]
            lines.append(f"peer {peer['name']} (transformers {h['transformers_version']}, batch 1, "
                         f"{peer['num_prompts']} prompts): TPOT {_ms(peer['hf_tpot_s'])} ms, "
                         f"{h['output_tok_s']:.1f} out tok/s, decode {h['decode_tok_s'] or 0:.1f} tok/s; "
                         f"vtcore c=1 TPOT {_ms(vt)} ms; vtcore/HF TPOT "
                         f"{'-' if ratio is None else f'{ratio:.2f}'}"
                         f"{'' if peer['tpot_ratio_note'] is None else ' (' + peer['tpot_ratio_note'] + ')'}")
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
