"""bf16 GEMV at small M: vtcore's Triton kernel against cuBLAS (F.linear), beside the copy bandwidth.

    python scripts/bench_gemv.py [--sweep] [--out DIR]
Each launch is timed inside a CUDA graph with CUDA events over rotating weight copies (>= 512 MB in all, so L2 never
holds the weight), median of 5 rounds of 20 launches; GB/s counts weight bytes only. ``--sweep`` also times, at M = 1,
a grid of forced launch configs per shape and prints the fastest beside the heuristic's (input for ``_config``).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics

import torch
import torch.nn.functional as F

from vtcore.kernels.gemv import _config, _num_sms, gemv

SHAPES = {"0.6b qkv": (4096, 1024), "0.6b o": (1024, 2048), "0.6b gate_up": (6144, 1024), "0.6b down": (1024, 3072),
          "4b qkv": (6144, 2560), "4b o": (2560, 4096), "4b gate_up": (19456, 2560), "4b down": (2560, 9728)}


def timed(fn, copies: list[torch.Tensor], x: torch.Tensor) -> float:
    """Median microseconds per launch, 20 launches captured in a CUDA graph (no host launch cost)."""
    for i in range(3):
        fn(x, copies[i % len(copies)])
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(20):
            fn(x, copies[i % len(copies)])
    rounds = []
    for _ in range(5):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        torch.cuda.synchronize()
        rounds.append(start.elapsed_time(end) * 1e3 / 20)
    return statistics.median(rounds)


def sweep(copies: list[torch.Tensor], k: int, n: int, default_us: float) -> list[dict]:
    """M = 1 over forced (block_n, block_k, split_k, num_warps)."""
    x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
    out = []
    for bn in (4, 8, 16):
        for bk in (512, 1024):
            if bk > k:
                continue
            for split in (1, 2, 4, 8):
                if k // bk < split:
                    continue
                for warps in (4, 8):
                    cfg = dict(block_n=bn, block_k=bk, split_k=split, num_warps=warps)
                    try:
                        us = timed(lambda xx, w: gemv(xx, w, **cfg), copies, x)
                    except Exception as e:  # noqa: BLE001 - a config the compiler refuses is skipped
                        print("skip", cfg, type(e).__name__)
                        continue
                    out.append({**cfg, "us": us})
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    ap.add_argument("--sweep", action="store_true")
    args = ap.parse_args()
    big = torch.empty(1 << 28, dtype=torch.uint8, device="cuda")
    copy_us = timed(lambda x, w: w.copy_(x), [big[: 1 << 27]], big[1 << 27:])
    copy_bw = 2 * (1 << 27) / copy_us / 1e3  # GB/s, read + write
    del big
    rows = []
    for name, (n, k) in SHAPES.items():
        nbytes = n * k * 2
        copies = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) for _ in range(max(2, (512 << 20) // nbytes))]
        for m in (1, 4, 16):
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            ours, cublas = timed(gemv, copies, x), timed(F.linear, copies, x)
            rows.append({"shape": name, "n": n, "k": k, "m": m, "mb": nbytes / 1e6, "triton_us": ours, "cublas_us": cublas,
                         "triton_frac_of_copy": nbytes / ours / 1e3 / copy_bw, "cublas_frac_of_copy": nbytes / cublas / 1e3 / copy_bw})
            r = rows[-1]
            print(f"{name:13s} M={m:2d} {r['mb']:6.1f} MB  triton {ours:7.2f} us ({r['triton_frac_of_copy']:.0%})  "
                  f"cublas {cublas:7.2f} us ({r['cublas_frac_of_copy']:.0%})")
        if args.sweep and name.startswith("0.6b"):
            rows[-3]["sweep"] = sweep(copies, k, n, ours_m1 := rows[-3]["triton_us"])
            best = min(rows[-3]["sweep"], key=lambda r: r["us"])
            print(f"{'':13s} M= 1 default {_config(1, n, k, 2, _num_sms(torch.device('cuda')), *[None] * 5)} "
                  f"{ours_m1:.2f} us; best {best}")
        del copies
    print(f"copy bandwidth {copy_bw:.0f} GB/s")
    if args.out:
        with open(os.path.join(args.out, "bench_gemv.json"), "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "copy_gb_s": copy_bw, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
