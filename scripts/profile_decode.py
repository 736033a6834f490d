"""Where a decode step's device time goes: GPU kernels by name, per step, for a model shape.

    python scripts/profile_decode.py --shape qwen3-0.6b --batch 1 [--enforce-eager] [--prefill | --verify K] [--out DIR]
Dummy bf16 weights; prompts of --input-len tokens; profiles --steps decode steps after warm-up (or,
``--prefill``, the step that prefills all --batch prompts, after a warm-up batch of the same shape; or,
``--verify K``, verify steps of K draft tokens a row: every step each row proposes its last token K
times, whatever the target accepts) and prints each kernel name's launches and
microseconds per step, largest first.
"""
from __future__ import annotations

import argparse
import collections
import json
import os
import sys
import tempfile
from typing import Sequence

import torch

from vtcore import LLM, SamplingParams
from vtcore.spec.proposer import PerSequence

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from model_shapes import SHAPES, write_shape  # noqa: E402


class RepeatLast(PerSequence):
    """Proposes a sequence's last token k times: a verify row of k drafts every step."""

    def propose(self, tokens: Sequence[int], k: int) -> list[int]:
        return [tokens[-1]] * k


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", choices=list(SHAPES), default="qwen3-0.6b")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--input-len", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--enforce-eager", action="store_true")
    ap.add_argument("--prefill", action="store_true")
    ap.add_argument("--verify", type=int, default=0, metavar="K")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        spec = {"speculative_config": {"method": "ngram", "num_speculative_tokens": args.verify}} if args.verify else {}
        llm = LLM(write_shape(tmp, args.shape), device="cuda", load_format="dummy", dtype="bfloat16",
                  max_num_seqs=max(args.batch, 1), enforce_eager=args.enforce_eager, **spec)
    eng = llm.engine
    g = torch.Generator().manual_seed(0)

    def add(tag: str, max_tokens: int) -> None:
        for i in range(args.batch):
            ids = torch.randint(0, eng.vocab_size, (args.input_len,), generator=g).tolist()
            eng.add_request(f"{tag}{i}", {"prompt_token_ids": ids},
                            SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True))

    steps = 1 if args.prefill else args.steps
    if args.verify:
        eng.scheduler.proposer = RepeatLast()
    if args.prefill:  # a warm-up batch of the same shape compiles the prefill kernels first
        add("warm", 1)
        while eng.has_unfinished_requests():
            eng.step()
        add("r", 1)
    else:
        add("r", args.steps + 16)
        for _ in range(8):  # prefill and the first decode steps
            eng.step()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            eng.step()
        torch.cuda.synchronize()
    per_name: dict[str, list[float]] = collections.defaultdict(list)
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            per_name[e.name].append(e.device_time)
    rows = sorted(((sum(v) / steps, len(v) / steps, n) for n, v in per_name.items()), reverse=True)
    total = sum(r[0] for r in rows)
    kind = "prefill" if args.prefill else f"verify k={args.verify}" if args.verify else "decode"
    print(f"{args.shape} batch {args.batch} {kind} "
          f"{'eager' if args.enforce_eager else 'graphs'}: "
          f"{total:.1f} us/step device, {sum(r[1] for r in rows):.1f} events/step")
    for us, count, name in rows[:30]:
        print(f"{us:9.1f} us {count:6.1f}x  {us / count:7.2f} us each  {name[:110]}")
    if args.out:
        tag = "-prefill" if args.prefill else f"-verify{args.verify}" if args.verify else ""
        with open(os.path.join(args.out, f"profile-{args.shape}-b{args.batch}{tag}.json"), "w") as f:
            json.dump([{"us_per_step": us, "per_step": c, "name": n} for us, c, n in rows], f, indent=1)


if __name__ == "__main__":
    main()
