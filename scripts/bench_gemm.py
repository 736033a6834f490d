"""Prefill-sized GEMMs (``F.linear``, bf16) through cuBLAS and through cuBLASLt, beside the copy and matmul rates.

    python scripts/bench_gemm.py [--m 128,1024,8192] [--out DIR]
The Qwen3-0.6B and Qwen3-4B projections at M rows (128: issue 21's hit chunk; 1,024 and 8,192: prompts), each
timed like ``scripts/bench_gemv.py`` (20 launches in a CUDA graph over rotating weight copies, >= 512 MB in all,
median of 5 replays), once per BLAS library torch can be told to prefer
(``torch.backends.cuda.preferred_blas_library``). Prints microseconds, TFLOP/s and the weight read in TB/s;
the floor a GEMM cannot beat is max(weight bytes / copy rate, FLOPs / the 8192^3 matmul rate), both measured here.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_gemv import SHAPES, copy_bandwidth, timed  # noqa: E402

LIBRARIES = ("cublas", "cublaslt")


def matmul_tflops() -> float:
    """bf16 TFLOP/s of an 8192^3 matmul, timed as the GEMMs are."""
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    return 2 * 8192 ** 3 / timed(lambda x, w: F.linear(x, w), [a], a) / 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--m", default="128,1024,8192")
    ap.add_argument("--shapes", default=",".join(SHAPES), help="comma-separated names of bench_gemv.SHAPES")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    copy_gbs = copy_bandwidth()
    rows, rates = [], {}
    for lib in LIBRARIES:
        torch.backends.cuda.preferred_blas_library(lib)
        rates[lib] = matmul_tflops()
    print(f"copy {copy_gbs:.0f} GB/s; 8192^3 matmul " + ", ".join(f"{lib} {r:.1f}" for lib, r in rates.items())
          + " TFLOP/s")
    rate = max(rates.values())
    for name in args.shapes.split(","):
        n, k = SHAPES[name]
        count = max(2, (512 << 20) // (2 * n * k))
        copies = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) for _ in range(count)]
        for m in (int(v) for v in args.m.split(",")):
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            floor_us = max(2 * n * k / copy_gbs / 1e3, 2 * m * n * k / rate / 1e6)
            row = {"shape": name, "m": m, "n": n, "k": k, "floor_us": floor_us}
            for lib in LIBRARIES:
                torch.backends.cuda.preferred_blas_library(lib)
                us = timed(lambda xx, w: F.linear(xx, w), copies, x)
                row[lib] = {"us": us, "tflops": 2 * m * n * k / us / 1e6, "weight_tbs": 2 * n * k / us / 1e6}
            rows.append(row)
            print(f"{name:>12} M={m:<5} floor {floor_us:8.1f} us | " + " | ".join(
                f"{lib} {row[lib]['us']:8.1f} us {row[lib]['tflops']:6.1f} TFLOP/s {row[lib]['weight_tbs']:5.2f} TB/s"
                for lib in LIBRARIES), flush=True)
        del copies
    torch.backends.cuda.preferred_blas_library("cublas")
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "bench_gemm.json"), "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "copy_gbs": copy_gbs, "matmul_tflops": rates,
                       "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
