"""A prefill step's device time by kernel on one GPU (torch.profiler), largest first.

    python scripts/profile_prefill_kernels.py [--shape qwen3-4b] [--input-len 1024] [--prefix-len 0] [--top 14]
        [--tag TAG]
Dummy bf16 weights of a real shape, one prompt of random ids at a time with ``max_tokens=1``: three warm-up
requests, then three profiled ones; each kernel's device time and launch count per request. Prefix caching is
off unless ``--prefix-len P``: then every prompt is one shared P-token prefix (cached by the warm-up) before
its ``--input-len`` random ids, so each profiled request is a prefix hit (issue 21's step). ``--tag``
prefixes every line (to tell a base on ``PYTHONPATH`` from the tree when two runs share one log); run it from
outside the repo for that, so the current directory shadows nothing.
"""
from __future__ import annotations

import argparse
import os
import random
import sys
import tempfile

import torch
from torch.profiler import ProfilerActivity, profile

from vtcore import LLM, SamplingParams

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from model_shapes import SHAPES, write_shape  # noqa: E402

REQUESTS = 3


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", choices=list(SHAPES), default="qwen3-4b")
    ap.add_argument("--input-len", type=int, default=1024)
    ap.add_argument("--prefix-len", type=int, default=0)
    ap.add_argument("--top", type=int, default=14)
    ap.add_argument("--tag", default="")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        llm = LLM(write_shape(tmp, args.shape), load_format="dummy", dtype="bfloat16",
                  enable_prefix_caching=args.prefix_len > 0)
    rng = random.Random(0)
    prefix = [rng.randrange(1000, 100000) for _ in range(args.prefix_len)]
    once = SamplingParams(max_tokens=1)

    def requests() -> None:
        for _ in range(REQUESTS):
            ids = prefix + [rng.randrange(1000, 100000) for _ in range(args.input_len)]
            llm.generate({"prompt_token_ids": ids}, once, use_tqdm=False)
        torch.cuda.synchronize()

    requests()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        requests()
    rows = sorted(((e.device_time_total / REQUESTS, e.count / REQUESTS, e.key) for e in prof.key_averages()
                   if e.device_time_total > 0), reverse=True)
    tag = f"[{args.tag}] " if args.tag else ""
    total = sum(r[0] for r in rows)
    print(f"{tag}{args.shape} {args.input_len} after a {args.prefix_len}-token cached prefix: device us per prefill "
          f"{total:.0f}")
    for us, count, key in rows[:args.top]:
        print(f"{tag}{us:9.1f} us {count:6.1f}x  {key[:110]}")


if __name__ == "__main__":
    main()
