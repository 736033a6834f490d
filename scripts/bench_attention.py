"""Decode attention at small batch: vtcore's split-KV Triton kernel beside the copy bandwidth.

    python scripts/bench_attention.py [--sweep] [--out DIR]
Qwen3-4B heads (32 query, 8 kv, head_dim 128), bf16, paged cache of 16-token blocks in shuffled order;
one call per "layer" over 36 separate caches (so L2 never holds the KV), the 36 calls captured in a
CUDA graph, median of 5 replays; microseconds per call and the KV bytes it reads against the copy
bandwidth measured in the same run. Contexts 1088 (the 1024 + 64 bench) and 4096 at batch 1, 1088 at
batch 8; ``max_context_len`` is the graph's 40960 as in the engine (the split count follows it). Each case
is timed waiting first and with ``early_reads`` (the engine's: consecutive calls overlap through PDL).
``--sweep`` forces (num_splits, block_n, num_warps) at batch 1.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import torch

from vtcore.kernels.paged_attention import decode_num_splits, paged_decode_attention

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_gemv import copy_bandwidth, replay_us  # noqa: E402

HEADS, KV_HEADS, HEAD_DIM, BLOCK, LAYERS, MAX_LEN = 32, 8, 128, 16, 36, 40960


def case(batch: int, ctx: int) -> tuple[list, torch.Tensor, torch.Tensor, torch.Tensor]:
    blocks = -(-ctx // BLOCK)
    g = torch.Generator().manual_seed(batch * 100003 + ctx)
    caches = [(torch.randn(batch * blocks * BLOCK, KV_HEADS, HEAD_DIM, generator=g).to("cuda", torch.bfloat16),
               torch.randn(batch * blocks * BLOCK, KV_HEADS, HEAD_DIM, generator=g).to("cuda", torch.bfloat16))
              for _ in range(LAYERS)]
    tables = torch.randperm(batch * blocks, generator=g).view(batch, blocks).to("cuda", torch.int32)
    lens = torch.full((batch,), ctx, dtype=torch.int32, device="cuda")
    q = torch.randn(batch, HEADS, HEAD_DIM, generator=g).to("cuda", torch.bfloat16)
    return caches, tables, lens, q


def timed(caches: list, tables: torch.Tensor, lens: torch.Tensor, q: torch.Tensor, **kw) -> float:
    out = torch.empty_like(q)

    def run() -> None:
        for k, v in caches:
            paged_decode_attention(q, k, v, tables, lens, HEAD_DIM ** -0.5, BLOCK, MAX_LEN, out, **kw)
    return replay_us(run, len(caches))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sweep", action="store_true")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    bw = copy_bandwidth()
    rows = []
    for batch, ctx in ((1, 1088), (1, 4096), (8, 1088)):
        c = case(batch, ctx)
        kv_bytes = 2 * batch * ctx * KV_HEADS * HEAD_DIM * 2
        us, early_us = timed(*c), timed(*c, early_reads=True)
        rows.append({"batch": batch, "ctx": ctx, "config": "default", "us": us, "early_reads_us": early_us,
                     "kv_bytes": kv_bytes, "splits": decode_num_splits(batch, KV_HEADS, MAX_LEN),
                     "copy_us": kv_bytes / bw / 1e3})
        print(f"batch {batch:2d} ctx {ctx:5d}: {us:6.2f} us, early reads {early_us:6.2f} us (splits "
              f"{rows[-1]['splits']}), KV {kv_bytes / 1e6:.1f} MB = {rows[-1]['copy_us']:.2f} us at copy bandwidth",
              flush=True)
        if args.sweep and batch == 1:
            for splits in (8, 16, 32, 64, 128, 256):
                for block_n in (16, 32, 64):
                    for warps in (1, 2, 4):
                        if splits * block_n > 4 * MAX_LEN:
                            continue
                        us = timed(*c, num_splits=splits, block_n=block_n, num_warps=warps)
                        rows.append({"batch": batch, "ctx": ctx, "config": [splits, block_n, warps], "us": us})
            best = sorted((r for r in rows if r["ctx"] == ctx and r["batch"] == batch and r["config"] != "default"),
                          key=lambda r: r["us"])[:6]
            for r in best:
                print(f"    splits, block_n, warps {r['config']}: {r['us']:.2f} us", flush=True)
    print(f"copy bandwidth {bw:.0f} GB/s")
    if args.out:
        with open(os.path.join(args.out, "bench_attention.json"), "w") as f:
            json.dump({"copy_gbs": bw, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
