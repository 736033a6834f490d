"""Where a prefill step's host time goes: cProfile of submitting one prefill step, beside its device time.

    python scripts/profile_prefill_host.py --shape qwen3-4b [--prefix-len 2048] [--input-len 128] [--out DIR]
Dummy bf16 weights, sync engine. A first request prefills the shared prefix plus --input-len tokens;
each later one shares the prefix (a prefix-cache hit) and computes --input-len tokens. Times the
submit (the host's launch of the whole forward) of the hit steps and of a step with caching off,
synchronised, and prints the cProfile of one hit submit, largest own time first.
"""
from __future__ import annotations

import argparse
import cProfile
import io
import os
import pstats
import random
import statistics
import sys
import tempfile
import time

import torch

from vtcore import LLM, SamplingParams

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from model_shapes import SHAPES, write_shape  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", choices=list(SHAPES), default="qwen3-4b")
    ap.add_argument("--prefix-len", type=int, default=2048)
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    sync = torch.cuda.synchronize if args.device == "cuda" else (lambda: None)
    rng = random.Random(0)
    prefix = [rng.randrange(1000) for _ in range(args.prefix_len)]
    greedy = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    report = io.StringIO()
    for caching in (True, False):
        with tempfile.TemporaryDirectory() as tmp:
            llm = LLM(write_shape(tmp, args.shape), device=args.device, load_format="dummy", dtype="bfloat16",
                      max_num_seqs=1, enable_prefix_caching=caching, max_model_len=args.prefix_len + 1024,
                      num_kv_blocks=2 * (args.prefix_len + 1024) // 16 + 8)
        runner = llm.engine.runner
        submits, walls = [], []
        orig = runner.submit

        def timed(batch):
            sync()
            t = time.perf_counter()
            handle = orig(batch)
            submits.append(time.perf_counter() - t)
            sync()
            walls.append(time.perf_counter() - t)
            return handle

        runner.submit = timed
        prompt = lambda: {"prompt_token_ids": prefix + [rng.randrange(1000) for _ in range(args.input_len)]}
        for _ in range(6):
            llm.generate(prompt(), greedy, use_tqdm=False)
        # each generate: one prefill step (max_tokens=1); the first two are warm-up
        print(f"caching={caching}: submit ms {[round(s * 1e3, 2) for s in submits]}, submit+device ms "
              f"{[round(w * 1e3, 2) for w in walls]}; median of the last 4: submit "
              f"{statistics.median(submits[2:]) * 1e3:.2f}, with device {statistics.median(walls[2:]) * 1e3:.2f}",
              file=report)
        if caching:
            runner.submit = orig
            prof = cProfile.Profile()
            llm.engine.runner.submit = lambda batch: prof.runcall(orig, batch)
            llm.generate(prompt(), greedy, use_tqdm=False)
            stats = io.StringIO()
            pstats.Stats(prof, stream=stats).sort_stats("tottime").print_stats(40)
            print(stats.getvalue(), file=report)
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA,
                                                    torch.profiler.ProfilerActivity.CPU]) as p:
                llm.generate(prompt(), greedy, use_tqdm=False)
                sync()
            print(p.key_averages().table(sort_by="self_cpu_time_total", row_limit=40), file=report)
            print(p.key_averages().table(sort_by="self_device_time_total", row_limit=25), file=report)
        del llm
        if args.device == "cuda":
            torch.cuda.empty_cache()
    print(report.getvalue())
    if args.out:
        with open(os.path.join(args.out, f"profile-prefill-host-{args.shape}.txt"), "w") as f:
            f.write(report.getvalue())


if __name__ == "__main__":
    main()
