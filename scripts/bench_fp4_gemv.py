"""FP4 W4A16 GEMV on a GPU: correctness against the torch reference in bf16, and bandwidth at M=1.

    python scripts/bench_fp4_gemv.py [--out DIR]

For Qwen3-4B projection shapes (hidden 2560, intermediate 9728, 32/8 heads of 128), NVFP4 and
MXFP4: the time of `fp4_matmul` at M=1 over rotating copies of the packed weights and scales
(at least 4x the 60 MB L2, so every call streams from HBM), the bytes it must move (packed weights,
scales, activations, output), the achieved bandwidth, and the device copy bandwidth measured in the
same run (a 1 GiB device-to-device copy, read + write bytes). Medians of `triton.testing.do_bench`.
"""
from __future__ import annotations

import argparse
import json
import os

import torch
import triton

from vtcore.kernels.fp4_gemm import fp4_matmul
from vtcore.quant.fp4 import fp4_linear_reference

SHAPES = {  # name: (N, K)
    "qkv_proj (q 4096 + k 1024 + v 1024, K 2560)": (6144, 2560),
    "o_proj (2560 x 4096)": (2560, 4096),
    "gate_up_proj (2 x 9728, K 2560)": (19456, 2560),
    "down_proj (2560 x 9728)": (2560, 9728),
}
L2_BYTES = 60 * 2**20


def copy_bandwidth() -> float:
    a = torch.empty(2**30, dtype=torch.uint8, device="cuda")
    b = torch.empty_like(a)
    ms = triton.testing.do_bench(lambda: b.copy_(a), warmup=50, rep=300, return_mode="median")
    return 2 * a.numel() / (ms * 1e-3)


def make(n: int, k: int, kind: str, g: torch.Generator) -> tuple:
    group = 16 if kind == "e4m3" else 32
    packed = torch.randint(0, 256, (n, k // 2), dtype=torch.uint8, device="cuda", generator=g)
    if kind == "e4m3":
        scale = (torch.rand(n, k // group, device="cuda", generator=g) * 2 + 0.1).to(torch.float8_e4m3fn)
        glob = torch.full((n,), 64.0, device="cuda")
    else:
        scale = torch.randint(115, 125, (n, k // group), dtype=torch.uint8, device="cuda", generator=g)
        glob = None
    return packed, scale, glob, group


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    g = torch.Generator(device="cuda").manual_seed(0)
    bw = copy_bandwidth()
    report = {"device": torch.cuda.get_device_name(), "copy_bandwidth_GBps": round(bw / 1e9, 1), "rows": []}
    print(f"{report['device']}: copy bandwidth {bw / 1e9:.0f} GB/s")
    for kind, fmt in (("e4m3", "NVFP4"), ("e8m0", "MXFP4")):
        for name, (n, k) in SHAPES.items():
            packed, scale, glob, group = make(n, k, kind, g)
            x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
            ref = fp4_linear_reference(x.float(), packed, scale, kind, glob, group)
            got = fp4_matmul(x, packed, scale.view(torch.uint8), kind, glob, group).float()
            rel = ((got - ref).norm() / ref.norm()).item()
            weight_bytes = packed.numel() + scale.numel()
            copies = max(1, -(-4 * L2_BYTES // weight_bytes))
            sets = [make(n, k, kind, g) for _ in range(copies)]
            i = [0]

            def call() -> None:
                p, s, gl, _ = sets[i[0] % copies]
                i[0] += 1
                fp4_matmul(x, p, s.view(torch.uint8), kind, gl, group)

            ms = triton.testing.do_bench(call, warmup=25, rep=200, return_mode="median")
            moved = weight_bytes + 2 * k + 2 * n
            row = {"format": fmt, "shape": name, "N": n, "K": k, "MB": round(weight_bytes / 1e6, 2),
                   "rel_err_bf16": float(f"{rel:.2e}"), "us": round(ms * 1e3, 2),
                   "GBps": round(moved / (ms * 1e-3) / 1e9, 1), "of_copy_bw": round(moved / (ms * 1e-3) / bw, 3)}
            report["rows"].append(row)
            print(f"{fmt} {name:<44} {row['MB']:7.2f} MB  rel err {rel:.1e}  {row['us']:8.2f} us  "
                  f"{row['GBps']:7.1f} GB/s = {row['of_copy_bw']:.0%} of copy")
    if args.out:
        with open(os.path.join(args.out, "bench_fp4_gemv.json"), "w") as f:
            json.dump(report, f, indent=2)


if __name__ == "__main__":
    main()
