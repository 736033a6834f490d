"""``vtcore bench``: a closed-loop serving benchmark through ``AsyncLLM``.

For each concurrency ``c`` the benchmark keeps ``c`` requests in flight (random prompt token ids of
``--input-len``, ``max_tokens=--output-len``, ``ignore_eos=True``, greedy) until ``--num-prompts``
requests (default ``4*c`` and at least 16, at least ``c``) have completed. Every statistic comes from
``time.perf_counter`` timestamps taken on the caller's event loop as outputs arrive:

* TTFT: first output token arrival - request send;
* TPOT: (latency - TTFT) / (output tokens - 1);
* ITL: the gaps between successive arrivals of new tokens of one request;
* throughput: tokens / wall time, the wall time running from the first send to the last completion.

``steps`` is the number of engine steps (prefill, mixed and decode) taken during a concurrency's run;
``host_submit_ms_mean`` is the mean wall time the engine thread spent in ``ModelRunner.submit`` per step
(preparing the batch on the host and enqueueing its device work; waiting for results is not included).
Per decode step (see :mod:`vtcore.bench.step_stats`): ``step_host_s`` splits those submit times into pure
decode steps (every sequence computes one token; ``decode_steps`` of them) and the others;
``decode_device`` holds the device ms, kernels, memcpys and wall ms per decode step that ``torch.profiler``
saw over a short window of a separate probe run after the measured one (CUDA only; None with
``reason`` ``"no CUDA device"`` on CPU).

Also measured in the same run: ``triton_compiles``, the Triton kernel variants built while a
concurrency was measured (each a stall; see :func:`vtcore.bench.step_stats.count_triton_compiles`), and

* ``roofline`` (always): the device copy bandwidth, measured before the engine is built, and per
  concurrency the bytes one decode step must move (parameters + KV read) with ``roofline_ms`` and
  ``TPOT / roofline``, and ``closed_loop``: that step's floor with the prompts the loop admits meanwhile
  (``TPOT / floor``); see :mod:`vtcore.bench.roofline`.
* ``prefill_floor`` (always): the compute floor of one prompt of ``--prefix-len + --input-len`` tokens
  computed from scratch (its operations at the rate of a square matmul of the model's dtype timed on the
  device before the engine is built, as the copy is) and the concurrency-1 run's median TTFT over it (a cached prefix
  can put that TTFT below the floor); see :mod:`vtcore.bench.roofline`.
* ``peer`` (``--peer hf``): HF transformers' ``generate`` (from the checkpoint, or with
  ``--load-format dummy`` random weights of the same shapes) after the engine is shut down: at batch 1
  on the first ``min(num_prompts, 4)`` prompts of the concurrency-1 run, its TPOT, tokens/s and
  ``tpot_ratio = vtcore_tpot_s / hf_tpot_s`` (``vtcore_tpot_s``: the mean TPOT of vtcore's
  concurrency-1 requests on those same prompts); and ``batched``: one ``generate`` of the first ``C``
  prompts of the largest concurrency ``C``'s run as one batch, its output tokens/s and
  ``throughput_ratio`` = vtcore's output throughput at ``C`` / HF's; see :mod:`vtcore.bench.peer`.
* ``--offline`` replaces the serving sweep with nano-vllm's benchmark shape: ``--num-prompts``
  (default 256) requests with input and output lengths drawn uniformly (seeded) from
  ``--offline-min-len..--offline-max-len`` (default 100..1024; the upper bound clamped to
  ``max_model_len // 2`` so every request fits), submitted at once through ``LLM.generate``
  (greedy, ``ignore_eos``); total time is the ``generate`` call's wall time, output tokens are
  counted from the returned outputs.
* ``--base-url URL`` replaces it with the same closed loop over OpenAI streaming HTTP against a running
  server (:mod:`vtcore.bench.http`; no engine in this process, so no step or device columns), driven by
  one client process per 8 streams (on the machine's cores less the 4 left to the server) unless
  ``--client-processes N`` says otherwise.
* ``--speculative-config JSON`` replaces it with :mod:`vtcore.bench.speculative`: per concurrency, the
  plain decode step, then for each k of ``--speculative-k`` the verify step and the effective TPOT of a
  replay proposer (the plain run's own greedy continuations, all accepted: the bound on the speedup),
  and the configured method's real acceptance.

The engine arguments are every command's (:mod:`vtcore.engine.arg_utils`, vLLM's names); ``--seed`` also
seeds the prompts. Recorded in the JSON header and the printed header line, with the resulting
``async_depth`` and ``decode_graph_sizes`` (the runner's padded decode batch sizes, one CUDA graph each
on CUDA, ``[]`` when eager): ``--enforce-eager``, ``--async-scheduling`` / ``--no-async-scheduling``
(recorded as ``on`` / ``off``; ``auto`` when neither is given: the family's default) and
``--max-num-seqs`` (default here: the largest concurrency of the grid, since the engine captures one
graph per padded size up to it at start-up; ``--offline``: 256).
"""
from __future__ import annotations

import argparse
import asyncio
import gc
import json
import os
import random
import time
from typing import Any, TextIO

import attrs

from vtcore.bench.loop_timer import PHASES, LoopTimer
from vtcore.bench.peer import PEER_CHOICES, format_peer
from vtcore.bench.roofline import DEFAULT_COPY_MIB
from vtcore.bench.speculative import DEFAULT_KS, format_speculative
from vtcore.bench.step_stats import (NO_CUDA, StepTimer, count_triton_compiles, init_profiler_on_this_thread,
                                     probe_decode, unavailable)
from vtcore.bench.structured_share import bench_schema, check_share, constrained_flags, format_groups, groups
from vtcore.bench.summary import MIN_REQUESTS, requests_per_concurrency, summarize
from vtcore.config import EngineConfig
from vtcore.engine.arg_utils import add_engine_args, engine_config_from_args, non_negative_int, positive_int
from vtcore.structured import StructuredOutputsParams

DEFAULT_CONCURRENCY = "1,2,4,8,16,32"
DEFAULT_INPUT_LEN = 1024
DEFAULT_OUTPUT_LEN = 128
#: why --input-len and --output-len are refused with --offline
_NOT_OFFLINE = ("does not apply with --offline (each request's prompt and output lengths are drawn from "
                "--offline-min-len..--offline-max-len)")
DEFAULT_OFFLINE_PROMPTS = 256
DEFAULT_OFFLINE_MIN_LEN, DEFAULT_OFFLINE_MAX_LEN = 100, 1024
DEFAULT_OFFLINE_MAX_NUM_SEQS = 256


#: how the header records ``async_scheduling``: not given (the family decides), ``--async-scheduling``,
#: ``--no-async-scheduling``
ASYNC_SCHEDULING_LABELS = {None: "auto", True: "on", False: "off"}


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


def json_path(text: str) -> str:
    """An argparse type for ``--json PATH``: a folder that does not exist fails now, not after the run."""
    if not os.path.isdir(os.path.dirname(os.path.abspath(text))):
        raise argparse.ArgumentTypeError(f"--json {text!r}: its folder does not exist")
    if os.path.isdir(text):
        raise argparse.ArgumentTypeError(f"--json {text!r}: a folder; expected a file's path")
    return text


def add_bench_parser(sub: Any) -> argparse.ArgumentParser:
    """Add the ``bench`` subcommand to ``sub`` (the parser's subparsers)."""
    p = sub.add_parser("bench", help="closed-loop serving benchmark through AsyncLLM (TTFT, TPOT, ITL, throughput)")
    add_engine_args(p, shown_defaults={"max_num_seqs": f"the largest --concurrency; --offline: "
                                                       f"{DEFAULT_OFFLINE_MAX_NUM_SEQS}"})
    p.add_argument("--concurrency", type=parse_concurrency, default=parse_concurrency(DEFAULT_CONCURRENCY),
                   help=f"requests kept in flight, comma-separated (default: {DEFAULT_CONCURRENCY})")
    p.add_argument("--input-len", type=positive_int("--input-len"), default=None,
                   help=f"prompt tokens per request (default: {DEFAULT_INPUT_LEN}, clamped to fit max_model_len)")
    p.add_argument("--output-len", type=positive_int("--output-len"), default=None,
                   help=f"output tokens per request (default: {DEFAULT_OUTPUT_LEN})")
    p.add_argument("--prefix-len", type=non_negative_int("--prefix-len"), default=0, metavar="N",
                   help="one shared prefix of N random tokens before every prompt of a run (its --input-len "
                        "tokens follow), for prefix caching (default: 0)")
    p.add_argument("--num-prompts", type=positive_int("--num-prompts"), default=None,
                   help=f"requests completed per concurrency (default: 4*c, at least {MIN_REQUESTS}; at least c)")
    p.add_argument("--turns", type=positive_int("--turns"), default=1, metavar="T",
                   help="multi-turn chat replay: each of --num-prompts conversations sends T requests in turn, "
                        "each resending the conversation so far (prompts and outputs) plus --input-len new "
                        "tokens (default: 1)")
    p.add_argument("--structured-share", type=float, default=0.0, metavar="F",
                   help="constrain this share of the requests (evenly interleaved) to a JSON schema "
                        "(bench_schema: an object of --output-len integers; xgrammar; over HTTP vLLM's "
                        "structured_outputs field); each run then reports the constrained and the unconstrained "
                        "requests' output throughput and TPOT apart (default: 0)")
    p.add_argument("--compare-prefix-caching", action="store_true",
                   help="run the sweep twice in one call, prefix caching off then on (fresh engines), and "
                        "report TTFT and throughput of the two side by side")
    p.add_argument("--peer", default=None, choices=list(PEER_CHOICES),
                   help="hf: also time HF transformers' generate on the same prompts, at batch 1 (needs "
                        "concurrency 1 for the TPOT ratio) and batched at the largest concurrency; with "
                        "--load-format dummy HF gets random weights of the same shapes")
    p.add_argument("--copy-mib", type=positive_int("--copy-mib"), default=DEFAULT_COPY_MIB,
                   help=f"size of the tensor copied to measure device bandwidth (default: {DEFAULT_COPY_MIB})")
    p.add_argument("--offline", action="store_true",
                   help="instead of the serving sweep: nano-vllm's offline benchmark through LLM.generate "
                        f"(--num-prompts, default {DEFAULT_OFFLINE_PROMPTS}, all at once; each prompt's and "
                        "output's length drawn from --offline-min-len..--offline-max-len, not --input-len and "
                        "--output-len)")
    p.add_argument("--offline-min-len", type=positive_int("--offline-min-len"), default=DEFAULT_OFFLINE_MIN_LEN)
    p.add_argument("--offline-max-len", type=positive_int("--offline-max-len"), default=DEFAULT_OFFLINE_MAX_LEN)
    p.add_argument("--speculative-k", type=parse_concurrency, default=list(DEFAULT_KS), metavar="K,K,...",
                   help="with --speculative-config: instead of the serving sweep, the verify step's cost and the "
                        "replay proposer's bound at each of these k, beside a plain decode step and the configured "
                        f"method (default: {','.join(map(str, DEFAULT_KS))}; see vtcore.bench.speculative)")
    p.add_argument("--base-url", default=None, metavar="URL",
                   help="instead of an engine in this process: the same closed loop over OpenAI streaming HTTP "
                        "against the server at URL (e.g. http://127.0.0.1:8000/v1; any OpenAI-compatible one), "
                        "--concurrency, --num-prompts, --input-len (default 1024), --output-len, --seed; see "
                        "vtcore.bench.http")
    p.add_argument("--serve", action="store_true",
                   help="also start `vtcore serve` on the same model and engine flags, run the loop against it "
                        "over HTTP, stop it, then run the loop in-process: served beside in-process, and where the "
                        "served TTFT goes (see vtcore.bench.served)")
    p.add_argument("--engine-core-process", action=argparse.BooleanOptionalAction, default=None,
                   help="with --serve: whether the server runs its engine in a process of its own (vtcore serve "
                        "--[no-]engine-core-process; default: serve's default, on)")
    p.add_argument("--client-processes", type=positive_int("--client-processes"), default=None, metavar="N",
                   help="with --base-url: client processes sharing each concurrency's streams (default: one per "
                        "8 streams, at most the cores)")
    p.add_argument("--json", type=json_path, default=None, metavar="PATH", help="also write every number as JSON")
    p.add_argument("--no-progress", action="store_true", help="no tqdm progress bar")
    p.set_defaults(func=cmd_bench)
    return p


# ---------------------------------------------------------------------------------------- the run
def resolve_lengths(max_model_len: int, input_len: int | None, output_len: int, prefix_len: int = 0
                    ) -> tuple[int, bool]:
    """(input_len, clamped): the default input length is clamped to fit after the ``prefix_len`` shared tokens;
    an explicit one must fit."""
    after = f"--prefix-len={prefix_len} + " if prefix_len else ""
    if prefix_len + output_len >= max_model_len:
        raise ValueError(f"{after}--output-len={output_len}: leaves no room for a prompt in "
                         f"max_model_len={max_model_len}")
    if input_len is None:
        fit = max_model_len - prefix_len - output_len
        return min(DEFAULT_INPUT_LEN, fit), DEFAULT_INPUT_LEN > fit
    if prefix_len + input_len + output_len > max_model_len:
        raise ValueError(f"{after}--input-len={input_len} + --output-len={output_len} = "
                         f"{prefix_len + input_len + output_len} exceeds max_model_len={max_model_len}")
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
            "ttft_s": ttft, "tpot_s": tpot, "itl_s": itl, "arrival_token_counts": counts,
            "_ids": list(comp.token_ids) if seen else []}  # popped by the caller (the next turn's history)


async def _run_concurrency(engine: Any, c: int, num_prompts: int, input_len: int, output_len: int,
                           vocab_size: int, rng: random.Random, progress: bool,
                           probe_rng: random.Random | None = None, prefix_len: int = 0, turns: int = 1,
                           structured_share: float = 0.0) -> dict[str, Any]:
    import torch
    from tqdm import tqdm

    from vtcore.sampling_params import SamplingParams

    prefix = [rng.randrange(vocab_size) for _ in range(prefix_len)]
    # conversation i's new tokens of each turn; a turn resends the conversation so far, then its own
    fresh = [[[rng.randrange(vocab_size) for _ in range(input_len)] for _ in range(turns)] for _ in range(num_prompts)]
    prompts = [prefix + f[0] for f in fresh]
    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    constrained = attrs.evolve(params, structured_outputs=StructuredOutputsParams(json=bench_schema(output_len)))
    is_constrained = constrained_flags(num_prompts, structured_share)
    inner = engine.engine
    queries0, hits0 = inner.pool.queries, inner.pool.hits
    cuda = inner.device.type == "cuda"
    if cuda:
        torch.cuda.synchronize(inner.device)
        torch.cuda.reset_peak_memory_stats(inner.device)
    next_index = 0
    results: list[dict[str, Any]] = []
    bar = tqdm(total=num_prompts * turns, desc=f"bench c={c}", unit="req", disable=not progress)

    async def worker() -> None:
        nonlocal next_index
        while next_index < num_prompts:
            i = next_index
            next_index += 1
            history = prompts[i]
            for t in range(turns):
                result = await _one_request(engine, f"bench-c{c}-{i * turns + t}", history,
                                            constrained if is_constrained[i] else params)
                result["constrained"] = is_constrained[i]
                results.append(result)
                history = history + result.pop("_ids") + (fresh[i][t + 1] if t + 1 < turns else [])
                bar.update(1)

    steps0 = inner.runner.steps_submitted
    with StepTimer(inner.runner) as timer, LoopTimer(inner) as loop:
        start = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(c)))
        end = time.perf_counter()
    steps = inner.runner.steps_submitted - steps0
    queries, hits = inner.pool.queries - queries0, inner.pool.hits - hits0
    bar.close()
    peak = int(torch.cuda.max_memory_allocated(inner.device)) if cuda else None
    # after the measured run, so the profiler cannot distort its TTFT/TPOT
    device_stats = (await probe_decode(engine, c, input_len, output_len, probe_rng or random.Random(c)) if cuda
                    else unavailable(NO_CUDA))
    decode_t, other_t = timer.split()
    results.sort(key=lambda r: int(r["request_id"].rsplit("-", 1)[1]))
    wall = end - start
    prompt_tokens = sum(r["prompt_tokens"] for r in results)
    output_tokens = sum(r["output_tokens"] for r in results)
    return {
        "concurrency": c, "num_prompts": num_prompts, "input_len": input_len, "output_len": output_len,
        "prefix_len": prefix_len, "turns": turns, "prefix_cache_queries": queries, "prefix_cache_hits": hits,
        "prefix_cache_hit_rate": hits / queries if queries else None,
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
        "decode_steps": len(decode_t),
        "step_host_s": {"decode": summarize(decode_t), "other": summarize(other_t)},
        "decode_device": device_stats,
        "engine_loop": loop.summary(),
        "peak_gpu_memory_bytes": peak,
        "structured_share": structured_share,
        "groups": groups(results, wall, structured_share),
        "requests": results,
        "_prompts": prompts,  # popped by run_bench (the HF peer reuses the concurrency-1 prompts)
    }


def _concurrency(args: argparse.Namespace) -> list[int]:
    """``--concurrency`` as a list (parsed already, or the text of a namespace built by hand)."""
    return parse_concurrency(args.concurrency) if isinstance(args.concurrency, str) else args.concurrency


def bench_engine_config(args: argparse.Namespace) -> EngineConfig:
    """The engine arguments given, over the bench's own default of ``max_num_seqs`` (the largest
    concurrency; ``--offline``: 256), over EngineConfig's."""
    offline = getattr(args, "offline", False)
    return engine_config_from_args(args, max_num_seqs=DEFAULT_OFFLINE_MAX_NUM_SEQS if offline
                                   else max(_concurrency(args)))


def knobs_doc(inner: Any) -> dict[str, Any]:
    """The knobs as recorded in the JSON header: read back from the engine, with what it made of them."""
    return {"enforce_eager": inner.config.enforce_eager, "prefix_caching": inner.pool.caching,
            "async_scheduling": ASYNC_SCHEDULING_LABELS[inner.config.async_scheduling],
            "max_num_seqs": inner.scheduler.max_num_seqs, "async_depth": inner.depth,
            "decode_graph_sizes": list(inner.runner.graph_sizes)}


def _knobs_line(doc: dict[str, Any]) -> str:
    sizes = doc["decode_graph_sizes"]
    return (f" enforce_eager={doc['enforce_eager']} async_scheduling={doc['async_scheduling']} "
            f"(depth {doc['async_depth']}) max_num_seqs={doc['max_num_seqs']} decode_graph_sizes="
            f"{','.join(map(str, sizes)) if sizes else 'none'} prefix_caching={doc.get('prefix_caching')}")


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


def run_offline(args: argparse.Namespace, config: EngineConfig) -> dict[str, Any]:
    """nano-vllm's benchmark: every request submitted at once through ``LLM.generate``; see the module doc.
    ``config`` names the checkpoint folder and ``max_model_len``."""
    from vtcore.engine.llm import LLM
    from vtcore.sampling_params import SamplingParams

    lo, hi, clamped = resolve_offline_lengths(config.max_model_len, args.offline_min_len, args.offline_max_len)
    n = args.num_prompts or DEFAULT_OFFLINE_PROMPTS
    llm = LLM(**attrs.asdict(config))
    inner = llm.engine
    rng = random.Random(config.seed)
    prompts = [{"prompt_token_ids": [rng.randrange(inner.vocab_size) for _ in range(rng.randint(lo, hi))]}
               for _ in range(n)]
    params = [SamplingParams(temperature=0.0, max_tokens=rng.randint(lo, hi), ignore_eos=True) for _ in range(n)]
    llm.generate([{"prompt_token_ids": [1, 2, 3, 4]}], SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True),
                 use_tqdm=False)  # warm-up, untimed
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=not getattr(args, "no_progress", False))
    wall = time.perf_counter() - start
    output_tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    prompt_tokens = sum(len(p["prompt_token_ids"]) for p in prompts)
    return {
        "device": str(inner.device), "dtype": str(inner.dtype).replace("torch.", ""),
        "knobs": knobs_doc(inner),
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


def _resolved_config(args: argparse.Namespace) -> tuple[EngineConfig, Any, dict[str, Any]]:
    """The engine config with the checkpoint resolved (a hub id: its cached snapshot) and max_model_len
    filled in, the checkpoint's HF config, and the JSON header."""
    from vtcore.config import HFConfig
    from vtcore.loading.hub import resolve_model

    given = bench_engine_config(args)
    path = resolve_model(given.model, weights=given.load_format != "dummy")
    hf = HFConfig.from_path(path)
    max_model_len = given.max_model_len or int(hf.get("max_position_embeddings", 4096))
    config = attrs.evolve(given, model=path, max_model_len=max_model_len)
    return config, hf, {"model": given.model, "load_format": config.load_format, "max_model_len": max_model_len,
                        "seed": config.seed}


def run_bench(args: argparse.Namespace, progress: bool = True) -> dict[str, Any]:
    """Build the engine, run every concurrency, return every number (the --json document)."""
    from vtcore.bench.roofline import (closed_loop_floor, decode_step_bytes, kv_bytes_per_token,
                                       measure_copy_bandwidth, measure_matmul_rate, parameter_bytes, prefill_flops,
                                       prefill_floor, roofline_for_run)
    from vtcore.engine.async_llm import AsyncLLM
    from vtcore.engine.llm_engine import resolve_device, resolve_dtype
    from vtcore.sampling_params import SamplingParams

    peer = getattr(args, "peer", None)
    if getattr(args, "offline", False) and peer:
        raise ValueError("--peer compares against the serving run at concurrency 1; it does not apply with --offline")
    if getattr(args, "offline", False) and getattr(args, "input_len", None) is not None:
        raise ValueError(f"--input-len={args.input_len}: {_NOT_OFFLINE}")
    if getattr(args, "output_len", None) is None:
        args = argparse.Namespace(**{**vars(args), "output_len": DEFAULT_OUTPUT_LEN})
    config, hf, header = _resolved_config(args)
    max_model_len = config.max_model_len
    if config.speculative_config is not None and not getattr(args, "offline", False):
        from vtcore.bench.speculative import run_speculative
        from vtcore.engine.llm_engine import LLMEngine

        input_len, clamped = resolve_lengths(max_model_len, args.input_len, args.output_len)
        return {**header, **run_speculative(config, _concurrency(args), args.speculative_k, input_len,
                                            args.output_len, getattr(args, "copy_mib", DEFAULT_COPY_MIB),
                                            LLMEngine), "input_len_clamped": clamped}
    if getattr(args, "offline", False):
        doc = run_offline(args, config)
        return {**header, "mode": "offline", "device": doc["device"], "dtype": doc["dtype"],
                **doc["knobs"], "timer": "time.perf_counter", "runs": [], "offline": doc["offline"]}
    concurrency = _concurrency(args)
    prefix_len = getattr(args, "prefix_len", 0) or 0
    turns = getattr(args, "turns", 1) or 1
    share = check_share(getattr(args, "structured_share", 0.0) or 0.0)
    input_len, clamped = resolve_lengths(max_model_len, args.input_len, args.output_len, prefix_len)
    longest = prefix_len + turns * (input_len + args.output_len)
    if longest > max_model_len:
        raise ValueError(f"--turns={turns} of --input-len={input_len} + --output-len={args.output_len} after "
                         f"--prefix-len={prefix_len} reach {longest} tokens, over max_model_len={max_model_len}")
    # measured before the engine exists, so its buffers never compete with the KV cache for memory
    on = resolve_device(config.device)
    copy = measure_copy_bandwidth(on, getattr(args, "copy_mib", DEFAULT_COPY_MIB))
    matmul = measure_matmul_rate(on, resolve_dtype(config.dtype, hf, on))
    if on.type == "cuda":
        init_profiler_on_this_thread()  # before the engine thread profiles its decode window
    engine = AsyncLLM(**attrs.asdict(config))
    inner = engine.engine
    knobs_rec = knobs_doc(inner)
    rng = random.Random(config.seed)
    model_obj = inner.runner.model
    param_bytes = parameter_bytes(model_obj)
    kv_per_token = kv_bytes_per_token(inner.runner.attention_layers, inner.dtype)
    device, dtype, vocab_size = inner.device, inner.dtype, inner.vocab_size

    async def warm_up(c: int) -> None:
        """Untimed: c requests of the measured prompt length, so lazy setup and Triton's compilation of
        size-specialised kernel variants happen before the clock starts (own rng: prompts unchanged);
        with --structured-share, every other one constrained: the bench schema is compiled by then."""
        wr, warm = random.Random(-1 - c), SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
        held = attrs.evolve(warm, structured_outputs=StructuredOutputsParams(json=bench_schema(args.output_len)))

        async def one(i: int) -> None:
            ids = [wr.randrange(inner.vocab_size) for _ in range(input_len)]
            params = held if share and i % 2 else warm
            async for _ in engine.generate({"prompt_token_ids": ids}, params, request_id=f"bench-warmup-{c}-{i}"):
                pass

        await asyncio.gather(*(one(i) for i in range(c)))

    async def main() -> list[dict[str, Any]]:
        runs = []
        for c in concurrency:
            await warm_up(c)
            n = requests_per_concurrency(c, args.num_prompts)
            with count_triton_compiles() as compiled:
                runs.append(await _run_concurrency(engine, c, n, input_len, args.output_len, inner.vocab_size, rng,
                                                   progress, random.Random(config.seed * 1_000_003 + c), prefix_len,
                                                   turns, share))
            runs[-1]["triton_compiles"] = compiled
        return runs

    try:
        floor = prefill_floor(prefill_flops(model_obj, inner.runner.attention_layers, prefix_len + input_len),
                              matmul, prefix_len + input_len)
        token_flops = prefill_flops(model_obj, [], 1)
        # a prompt's new tokens at least (a shared prefix may be cached): the closed loop's floor stays a floor
        new_flops = floor["flops"] if not prefix_len else prefill_flops(model_obj, inner.runner.attention_layers,
                                                                        input_len)
        runs = asyncio.run(main())
    finally:
        engine.shutdown()
    prompts_by_c: dict[int, list[list[int]]] = {}  # the HF peer reuses c=1's and the largest c's prompts
    for r in runs:
        prompts_by_c.setdefault(r["concurrency"], r.pop("_prompts"))
        step = decode_step_bytes(parameter_bytes(model_obj, r["concurrency"]), kv_per_token, r["concurrency"],
                                 prefix_len + input_len, args.output_len)
        r["roofline"] = roofline_for_run(step, copy["bandwidth_bytes_s"], r["tpot_s"]["mean"])
        r["roofline"]["closed_loop"] = closed_loop_floor(step, copy["bandwidth_bytes_s"], token_flops, new_flops,
                                                         matmul["flop_s"], r["concurrency"], args.output_len,
                                                         r["tpot_s"]["mean"])
    doc = {
        **header, "mode": "serving", "device": str(device), "dtype": str(dtype).replace("torch.", ""),
        "input_len": input_len, "input_len_clamped": clamped, "output_len": args.output_len, "prefix_len": prefix_len,
        **knobs_rec, "timer": "time.perf_counter", "runs": runs,
        "roofline": {"param_bytes": param_bytes, "kv_bytes_per_token": kv_per_token,
                     "kv_context_tokens_per_seq": prefix_len + input_len + args.output_len / 2,
                     "copy_bandwidth_bytes_s": copy["bandwidth_bytes_s"], "copy": copy},
        "prefill_floor": {**floor, "ttft_median_over_floor": _ttft_over_floor(runs, floor)},
    }
    if peer:
        pad = hf.get("pad_token_id", None)
        del engine, inner, model_obj  # free vtcore's weights and KV cache before HF loads its copy
        gc.collect()
        if device.type == "cuda":
            import torch
            torch.cuda.empty_cache()
        from vtcore.bench.peer import peer_section
        doc["peer"] = peer_section(peer, config, device, dtype, args, runs, prompts_by_c, input_len, vocab_size,
                                   rng, pad)
    return doc


def _ttft_over_floor(runs: list[dict[str, Any]], floor: dict[str, Any]) -> float | None:
    """The concurrency-1 run's median TTFT over the prompt's compute floor (None without either)."""
    lone = next((r for r in runs if r["concurrency"] == 1), None)
    if lone is None or floor["floor_ms"] is None:
        return None
    return lone["ttft_s"]["median"] * 1e3 / floor["floor_ms"]


def _num(x: float | None, fmt: str) -> str:
    return "-" if x is None else format(x, fmt)


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
                f"{' (clamped to fit max_model_len=' + str(doc['max_model_len']) + ')' if o['lengths_clamped'] else ''}"
                f"{_knobs_line(doc)}\n"
                f"offline: prompt tokens {o['prompt_tokens']}, output tokens {o['output_tokens']}, "
                f"time {o['wall_s']:.2f} s, output {o['output_throughput_tok_s']:.1f} tok/s, "
                f"total {o['total_throughput_tok_s']:.1f} tok/s\n")
    head = (f"{'conc':>5} {'reqs':>5} {'wall s':>8} {'tok/s':>10} {'out tok/s':>10} "
            f"{'TTFT ms mean/med/p90/p99':>28} {'TPOT ms mean/med/p90/p99':>28} {'ITL ms mean/med/p90/p99':>28} "
            f"{'steps':>6} {'host ms':>8} {'dec host ms med/p90':>19} {'dev ms':>7} {'kernels':>7} "
            f"{'peak MiB':>9} {'roof ms':>8} {'TPOT/roof':>9} {'hit %':>6}")
    lines = [f"model={doc['model']} device={doc['device']} dtype={doc['dtype']} input_len={doc['input_len']}"
             f"{' (clamped to fit max_model_len=' + str(doc['max_model_len']) + ')' if doc['input_len_clamped'] else ''}"
             f" output_len={doc['output_len']}{_knobs_line(doc)}", head]
    for r in doc["runs"]:
        def q(s: dict) -> str:
            return "/".join(_ms(s[k]) for k in ("mean", "median", "p90", "p99"))
        peak = r["peak_gpu_memory_bytes"]
        host = r["host_submit_ms_mean"]
        dh, dev = r["step_host_s"]["decode"], r["decode_device"]
        roof = r["roofline"]
        ratio = roof["tpot_over_roofline"]
        lines.append(f"{r['concurrency']:>5} {r['num_prompts']:>5} {r['wall_s']:>8.2f} "
                     f"{r['total_throughput_tok_s']:>10.1f} {r['output_throughput_tok_s']:>10.1f} "
                     f"{q(r['ttft_s']):>28} {q(r['tpot_s']):>28} {q(r['itl_s']):>28} {r['steps']:>6} "
                     f"{'-' if host is None else f'{host:.2f}':>8} "
                     f"{_ms(dh['median']) + '/' + _ms(dh['p90']):>19} "
                     f"{_num(dev['device_ms_per_step'], '.3f'):>7} {_num(dev['kernels_per_step'], '.1f'):>7} "
                     f"{'-' if peak is None else f'{peak / 2**20:.1f}':>9} "
                     f"{roof['roofline_ms']:>8.3f} {'-' if ratio is None else f'{ratio:.1f}':>9} "
                     f"{_num(None if r.get('prefix_cache_hit_rate') is None else 100 * r['prefix_cache_hit_rate'], '.1f'):>6}")
    rl = doc["roofline"]
    lines += ["", f"roofline: copy bandwidth {_gb(rl['copy_bandwidth_bytes_s'])} GB/s (read+write of "
                  f"{rl['copy']['nbytes'] / 2**20:.0f} MiB, median of {len(rl['copy']['times_s'])} copies); "
                  f"params {rl['param_bytes'] / 1e6:.2f} MB; KV {rl['kv_bytes_per_token']} B/token x "
                  f"{rl['kv_context_tokens_per_seq']:g} tokens/seq; TPOT/roof uses the mean TPOT"]
    pf = doc.get("prefill_floor")
    if pf is not None:
        mm = pf["matmul"]
        lines.append(f"prefill floor: {pf['prompt_tokens']}-token prompt, " + (
            "not counted (packed weights)" if pf["flops"] is None else
            f"{pf['flops'] / 1e12:.3f} TFLOP at {mm['flop_s'] / 1e12:.1f} TFLOP/s ({mm['dtype']} {mm['side']}^3 "
            f"matmul, median of {len(mm['times_s'])}): {pf['floor_ms']:.3f} ms; TTFT median at c=1 / floor: "
            f"{_num(pf['ttft_median_over_floor'], '.2f')}"))
    for r in doc["runs"]:
        cl = r["roofline"].get("closed_loop")
        if cl is not None:
            lines.append(f"closed-loop floor c={r['concurrency']}: {cl['floor_ms']:.3f} ms a step = KV "
                         f"{cl['kv_ms']:.3f} + max(weights {cl['weights_ms']:.3f}, matmuls {cl['matmul_ms']:.3f}: "
                         f"{cl['prompts_per_step']:.2f} prompts a step beside the decode rows); TPOT mean / floor "
                         f"{_num(cl['tpot_over_floor'], '.2f')}")
    for r in doc["runs"]:
        d = r["decode_device"]
        lines.append(f"decode step c={r['concurrency']}: host {_ms(r['step_host_s']['decode']['median'])} ms median"
                     f" over {r['decode_steps']} decode steps; " + (
                         f"profiled {d['steps']} steps (batch {_num(d.get('mean_batch_size'), '.1f')}, "
                         f"{d['profiler']}): wall {_num(d['wall_ms_per_step'], '.3f')} ms, device "
                         f"{_num(d['device_ms_per_step'], '.3f')} ms"
                         + (f" (collectives {d['collective_ms_per_step']:.3f} ms)" if d.get("collective_ms_per_step")
                            else "")
                         + f", kernels {_num(d['kernels_per_step'], '.1f')}, "
                         f"memcpy {_num(d['memcpy_per_step'], '.1f')}, memset {_num(d['memset_per_step'], '.1f')}"
                         f" per step" if d["profiled"] else "device time and kernels not measured")
                     + ("" if d["reason"] is None else f" ({d['reason']})")
                     + f"; Triton compiles while measured: {len(r['triton_compiles'])}"
                     + (f" ({', '.join(sorted(set(r['triton_compiles'])))})" if r["triton_compiles"] else ""))
    for r in doc["runs"]:
        loop = r.get("engine_loop")
        if loop and loop["steps"]:
            lines.append(f"engine loop c={r['concurrency']}, ms a step over {loop['steps']} steps: " + ", ".join(
                f"{p.replace('_', ' ')} {loop['ms_per_step'][p]:.3f}" for p in PHASES))
    for r in doc["runs"]:
        lines += format_groups(r)
    if doc.get("prefix_caching_off"):
        lines += format_comparison(doc)
    if doc.get("peer"):
        lines += format_peer(doc["peer"], _ms)
    return "\n".join(lines) + "\n"


def run_compared(args: argparse.Namespace, progress: bool = True) -> dict[str, Any]:
    """The serving sweep with prefix caching off (its runs under ``prefix_caching_off``), then on (the
    document), each on a fresh engine, the prompts drawn alike from the same seed."""
    if getattr(args, "offline", False):
        raise ValueError("--compare-prefix-caching compares serving sweeps; it does not apply with --offline")
    if getattr(args, "speculative_config", None) is not None:
        raise ValueError("--compare-prefix-caching compares serving sweeps; with --speculative-config the bench "
                         "measures speculative decoding instead")
    off = argparse.Namespace(**{**vars(args), "enable_prefix_caching": False, "peer": None})
    keep = ("concurrency", "prefix_cache_hit_rate", "ttft_s", "tpot_s", "output_throughput_tok_s", "wall_s")
    off_runs = [{k: r[k] for k in keep} for r in run_bench(off, progress)["runs"]]
    doc = run_bench(argparse.Namespace(**{**vars(args), "enable_prefix_caching": True}), progress)
    doc["prefix_caching_off"] = {"runs": off_runs}
    return doc


def format_comparison(doc: dict[str, Any]) -> list[str]:
    """One line per concurrency: prefix caching off beside on (median TTFT: the first request of a shared
    prefix always misses; output throughput; hit rate)."""
    lines = []
    for off, on in zip(doc["prefix_caching_off"]["runs"], doc["runs"]):
        t_off, t_on = off["ttft_s"]["median"], on["ttft_s"]["median"]
        ratio = f"{t_on / t_off:.2f}x" if t_off and t_on is not None else "-"
        rate = on["prefix_cache_hit_rate"]
        lines.append(f"prefix caching off -> on, c={on['concurrency']}: TTFT median {_ms(t_off)} -> {_ms(t_on)} ms "
                     f"({ratio}), output {off['output_throughput_tok_s']:.1f} -> {on['output_throughput_tok_s']:.1f}"
                     f" tok/s ({on['output_throughput_tok_s'] / off['output_throughput_tok_s']:.2f}x), hit rate "
                     f"{'-' if rate is None else f'{100 * rate:.1f}%'}")
    return lines


def _in_process_only(args: argparse.Namespace) -> list[str]:
    """The flags given that only the in-process bench honours."""
    return [flag for flag, on in (("--compare-prefix-caching", args.compare_prefix_caching),
                                  ("--offline", args.offline), ("--peer", args.peer),
                                  ("--speculative-config", getattr(args, "speculative_config", None)),
                                  ("--turns", (getattr(args, "turns", 1) or 1) > 1)) if on]


def cmd_bench(args: argparse.Namespace, out: TextIO) -> int:
    if args.offline and args.output_len is not None:
        raise ValueError(f"--output-len={args.output_len}: {_NOT_OFFLINE}")
    args.output_len = DEFAULT_OUTPUT_LEN if args.output_len is None else args.output_len
    progress = not getattr(args, "no_progress", False)
    local = _in_process_only(args)
    if getattr(args, "base_url", None):
        from vtcore.bench.http import format_http, run_http

        if args.serve or args.engine_core_process is not None or local:
            flag = "--serve" if args.serve else "--[no-]engine-core-process" if args.engine_core_process is not None \
                else local[0]
            raise ValueError(f"--base-url measures a server as it runs; {flag} needs an engine in this process")
        doc = run_http(args.base_url, _concurrency(args), args.num_prompts, args.input_len or DEFAULT_INPUT_LEN,
                       args.output_len, getattr(args, "seed", None) or 0, processes=args.client_processes,
                       structured_share=check_share(args.structured_share), prefix_len=args.prefix_len)
        out.write(format_http(doc))
    elif args.serve:
        from vtcore.bench.http import format_http
        from vtcore.bench.served import format_served, run_served

        if local:
            raise ValueError(f"--serve compares the served loop with the in-process one; the served loop cannot take "
                             f"{local[0]}")
        check_share(args.structured_share)
        doc = run_served(args, _concurrency(args), args.input_len or DEFAULT_INPUT_LEN, progress)
        out.write(format_http(doc["served"]) + format_table(doc["inprocess"]))
        out.writelines(line + "\n" for line in format_served(doc))
    else:
        if args.client_processes:
            raise ValueError(f"--client-processes={args.client_processes}: only with --base-url or --serve "
                             "(the HTTP client)")
        if args.engine_core_process is not None:
            raise ValueError("--[no-]engine-core-process: only with --serve (the server's engine)")
        doc = run_compared(args, progress) if getattr(args, "compare_prefix_caching", False) else \
            run_bench(args, progress)
        out.write(format_speculative(doc) if doc["mode"] == "speculative" else format_table(doc))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(doc, f, indent=2)
            f.write("\n")
        out.write(f"wrote {args.json}\n")
    return 0
