"""Where a concurrency-1 request's TTFT goes, in-process (``AsyncLLM``), on one GPU.

    python scripts/ttft_breakdown.py [--shape qwen3-4b | --model DIR] [--input-len 1024] [--prefix-len 0]
        [--requests 6] [--profile N] [--device cuda] [--out DIR]
Dummy bf16 weights of a real shape (``--model``: of a checkpoint folder's config.json instead, e.g. a small one for
the host's parts on the CPU). Each request (``max_tokens=1``, one at a time, random ids; with
``--prefix-len N`` every prompt starts with the same N ids, the prefix cache's hit case of issue 21) is
timed from the moment the caller starts ``generate`` to the moment its first output reaches the caller,
split by the engine thread's own calls, each stamped on entry and exit with ``time.perf_counter``:

* ``hand-off``: the caller's start to ``LLMEngine.add_request`` on the engine thread;
* ``add``, ``schedule``, ``submit``: the engine's own calls (``submit``: staging and enqueueing the step);
* ``device``: CUDA events around the submitted work (the device's time for the step, which overlaps
  ``wait``);
* inside ``submit``, each stamped too: ``layout`` (a padded step's rows, ``DecodeGraphs.prepare``), ``stage``
  (the host buffer), ``sampling`` (the sampler's metadata), ``upload`` (the copy enqueued), ``replay`` (the
  graph's launch); ``submit`` minus them is the rest (state copies, the block-table copy, sampling launches);
* ``wait``: ``StepHandle.result`` (blocked on the device, the tokens' copy included);
* ``outputs``: the rest of the steps (the prefix cache's registration after each submit, the finishing
  step's outputs built);
* ``delivery``: the output handed to the caller's event loop until the caller has it.

The gaps between these (the engine thread waking, steps between) make up ``other``. Medians over the
requests after the first two (the first pay for the path's first use).
"""
from __future__ import annotations

import argparse
import asyncio
import cProfile
import json
import os
import pstats
import statistics
import sys
import tempfile
import time
from typing import Any

import torch

from vtcore import SamplingParams
from vtcore.engine.async_llm import AsyncLLM
from vtcore.worker.model_runner import StepHandle

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from model_shapes import SHAPES, write_shape  # noqa: E402


#: the stamped parts of ``submit`` (module docstring)
SUBMIT_PARTS = ("layout", "stage", "sampling", "upload", "replay")


class Stamps:
    """(name, "in" | "out", perf_counter) of each wrapped call, and CUDA event pairs around ``submit``."""

    def __init__(self) -> None:
        self.log: list[tuple[str, str, float]] = []
        self.events: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []
        self.profile: cProfile.Profile | None = None  # set: the wrapped calls run under it
        self.profiling = False  # inside a profiled call (Python 3.12's profiler cannot be enabled twice)

    def wrap(self, owner: Any, name: str, label: str, cuda: bool = False) -> None:
        original = getattr(owner, name)

        def stamped(*args: Any, **kwargs: Any) -> Any:
            self.log.append((label, "in", time.perf_counter()))
            if cuda and torch.cuda.is_available():
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
            try:
                if self.profile is not None and label not in ("step", "wait") and not self.profiling:
                    self.profiling = True
                    try:
                        return self.profile.runcall(original, *args, **kwargs)
                    finally:
                        self.profiling = False
                return original(*args, **kwargs)
            finally:
                if cuda and torch.cuda.is_available():
                    end.record()
                    self.events.append((start, end))
                self.log.append((label, "out", time.perf_counter()))

        setattr(owner, name, stamped)


def span(log: list[tuple[str, str, float]], label: str) -> float:
    """Total time inside ``label``'s calls in ``log`` (calls not nested in themselves)."""
    total, start = 0.0, None
    for name, edge, t in log:
        if name == label:
            if edge == "in":
                start = t
            elif start is not None:
                total += t - start
                start = None
    return total


def _durations(log: list[tuple[str, str, float]]) -> list[tuple[tuple[str, str, float], float]]:
    """Each call's exit stamp with its entry time, in exit order."""
    open_: dict[str, float] = {}
    out = []
    for entry in log:
        name, edge, t = entry
        if edge == "in":
            open_[name] = t
        elif name in open_:
            out.append((entry, open_.pop(name)))
    return out


async def one(llm: AsyncLLM, rid: str, ids: list[int], stamps: Stamps) -> dict[str, float]:
    params = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    first = len(stamps.log), len(stamps.events)
    t0 = time.perf_counter()
    async for _ in llm.generate({"prompt_token_ids": ids}, params, rid):
        t_end = time.perf_counter()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    log = [e for e in stamps.log[first[0]:] if e[2] <= t_end]
    add_in = next(t for name, edge, t in log if name == "add" and edge == "in")
    deliver_in = max(t for name, edge, t in log if name == "deliver" and edge == "in")
    parts = {"hand-off": add_in - t0, **{k: span(log, k) for k in ("add", "schedule", "submit", "wait")}}
    inside = {k: span(log, k) for k in SUBMIT_PARTS}
    steps = span(log, "step")
    parts["outputs"] = steps - parts["schedule"] - parts["submit"] - parts["wait"]
    parts["delivery"] = t_end - deliver_in
    total = t_end - t0
    parts["other"] = total - sum(parts.values())
    parts = {k: v * 1e3 for k, v in {**parts, **inside}.items()}
    parts["device"] = sum(s.elapsed_time(e) for s, e in stamps.events[first[1]:])
    parts["ttft"] = total * 1e3
    parts["steps"] = sum(1 for name, edge, _ in log if name == "step" and edge == "in")
    parts["calls"] = [(name, round((t - start) * 1e3, 3)) for (name, edge, t), start in _durations(log)]
    return parts


async def run(args: argparse.Namespace, path: str) -> dict[str, Any]:
    llm = AsyncLLM(path, device=args.device, load_format="dummy", dtype="bfloat16", max_num_seqs=8)
    eng = llm.engine
    stamps = Stamps()
    stamps.wrap(eng, "add_request", "add")
    stamps.wrap(eng, "step", "step")
    stamps.wrap(eng.scheduler, "schedule", "schedule")
    stamps.wrap(eng.runner, "submit", "submit", cuda=True)
    stamps.wrap(StepHandle, "result", "wait")
    for graphs in eng.runner._padded:  # (instances: each padded kind's own)
        stamps.wrap(graphs, "prepare", "layout")
    stamps.wrap(eng.runner.staging, "stage", "stage")
    stamps.wrap(eng.runner.sampler, "prepare", "sampling")
    stamps.wrap(eng.runner.staging, "upload", "upload")
    stamps.wrap(torch.cuda.CUDAGraph, "replay", "replay")
    stamps.wrap(llm, "_deliver", "deliver")
    g = torch.Generator().manual_seed(0)
    prefix = torch.randint(0, eng.vocab_size, (args.prefix_len,), generator=g).tolist()
    rows = []
    try:
        for i in range(args.requests):
            if args.profile and i == args.requests - 1:
                stamps.profile = cProfile.Profile()
            ids = prefix + torch.randint(0, eng.vocab_size, (args.input_len,), generator=g).tolist()
            rows.append(await one(llm, f"r{i}", ids, stamps))
            await asyncio.sleep(0.05)
    finally:
        llm.shutdown()
    kept = rows[2:len(rows) - bool(args.profile)] or rows  # (the profiled request is slowed by it)
    if stamps.profile is not None:
        print("cProfile of the last request's engine calls (wait excluded), own / cumulative us:")
        rows_ = pstats.Stats(stamps.profile).stats.items()  # (file, line, name) -> (calls, _, own s, cum s, _)
        for (file, line, name), (_, calls, own, cum, _) in sorted(rows_, key=lambda r: -r[1][2])[:args.profile]:
            print(f"{own * 1e6:9.1f} {cum * 1e6:9.1f} {calls:6d}  {os.path.basename(file)}:{line}({name})")
    return {"shape": args.model or args.shape, "input_len": args.input_len, "prefix_len": args.prefix_len,
            "device": torch.cuda.get_device_name() if args.device == "cuda" else "cpu",
            "median_ms": {k: statistics.median(r[k] for r in kept) for k in kept[0] if k != "calls"}, "requests": rows}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", choices=list(SHAPES), default="qwen3-4b")
    ap.add_argument("--model", default=None, help="a checkpoint folder, in place of --shape")
    ap.add_argument("--input-len", type=int, default=1024)
    ap.add_argument("--prefix-len", type=int, default=0)
    ap.add_argument("--requests", type=int, default=6)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--profile", type=int, default=0, metavar="N",
                    help="cProfile the engine's calls for the last request (left out of the medians: the profiler "
                         "slows it) and print the N largest own times")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    if args.requests < 1 + bool(args.profile):
        ap.error(f"--requests {args.requests}: expected at least {1 + bool(args.profile)}")
    with tempfile.TemporaryDirectory() as tmp:
        result = asyncio.run(run(args, args.model or write_shape(tmp, args.shape)))
    med = result["median_ms"]
    print(f"{result['shape']} prompt {args.prefix_len}+{args.input_len} on {result['device']}: TTFT median "
          f"{med['ttft']:.2f} ms, device {med['device']:.2f} ms over {med['steps']:.0f} step(s); ms: "
          + ", ".join(f"{k} {med[k]:.3f}" for k in ("hand-off", "add", "schedule", "submit", "wait", "outputs",
                                                    "delivery", "other"))
          + "; inside submit: " + ", ".join(f"{k} {med[k]:.3f}" for k in SUBMIT_PARTS))
    print("calls of the last request not profiled (ms):", result["requests"][-1 - bool(args.profile)]["calls"])
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        name = f"ttft-{os.path.basename(os.path.normpath(result['shape']))}-{args.prefix_len}-{args.input_len}.json"
        with open(os.path.join(args.out, name), "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
