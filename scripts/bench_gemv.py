"""GEMV at small M: vtcore's Triton kernel against cuBLAS (F.linear), beside the copy bandwidth.

    python scripts/bench_gemv.py [--sweep] [--fp4] [--out DIR]
Each launch is timed inside a CUDA graph with CUDA events over rotating weight copies (>= 512 MB in all, so L2 never
holds the weight), median of 5 rounds of 20 launches; GB/s counts weight bytes only. ``--sweep`` also times, at M = 1,
a grid of forced launch configs per shape and prints the fastest beside the heuristic's (input for ``_config``).
``--fp4`` times instead the NVFP4 W4A16 GEMV at M = 1 (bytes: packed codes and scales) on the NVFP4 Qwen3-4B shapes,
by default (on tensor cores for bf16 x, registers capped by ``_registers``), with ptxas's own register count
(``maxnreg=0``) and with the float32 decode (``fp4_mma=0``), the sweep forcing tiles, warps, splits and, on the
tensor-core tiles, the register cap (``mma`` marks the configs the tensor-core path takes), gate_up also with its
SwiGLU epilogue (``gemv_swiglu``), and the fused MoE's two grouped decode launches for the 8 routed experts of one
Qwen3.5-35B-A3B layer (per kernel, from the profiler, over random expert picks in >= 4x L2 of experts).
"""
from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics

import torch
import torch.nn.functional as F

from vtcore.kernels.device import num_sms
from vtcore.kernels.gemv import _config, fp4_mma_tile, gemv, gemv_swiglu
from vtcore.kernels.fp4 import FP4Weight

SHAPES = {"0.6b qkv": (4096, 1024), "0.6b o": (1024, 2048), "0.6b gate_up": (6144, 1024), "0.6b down": (1024, 3072),
          "4b qkv": (6144, 2560), "4b o": (2560, 4096), "4b gate_up": (19456, 2560), "4b down": (2560, 9728)}


def replay_us(run, calls: int) -> float:
    """Median microseconds per call of ``run`` (``calls`` launches), captured in a CUDA graph after
    warm-up calls (no host launch cost), over 5 replays."""
    run()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        run()
    rounds = []
    for _ in range(5):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        torch.cuda.synchronize()
        rounds.append(start.elapsed_time(end) * 1e3 / calls)
    return statistics.median(rounds)


def timed(fn, copies: list[torch.Tensor], x: torch.Tensor) -> float:
    """Median microseconds per launch, 20 launches captured in a CUDA graph (no host launch cost)."""
    for i in range(3):
        fn(x, copies[i % len(copies)])

    def run() -> None:
        for i in range(20):
            fn(x, copies[i % len(copies)])
    return replay_us(run, 20)


def copy_bandwidth() -> float:
    """GB/s (read + write) of a 128 MiB device copy, timed as the kernels are."""
    big = torch.empty(1 << 28, dtype=torch.uint8, device="cuda")
    return 2 * (1 << 27) / timed(lambda x, w: w.copy_(x), [big[: 1 << 27]], big[1 << 27:]) / 1e3


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


FP4_SHAPES = {"4b gate_up": (19456, 2560), "4b down": (2560, 9728), "4b qkv": (6144, 2560), "4b o": (2560, 4096)}


def nvfp4_weight(n: int, k: int) -> FP4Weight:
    packed = torch.randint(0, 256, (n, k // 2), device="cuda", dtype=torch.uint8)
    scale = torch.randint(0x30, 0x40, (n, k // 16), device="cuda", dtype=torch.uint8)
    return FP4Weight(packed, scale, "e4m3", 16, torch.full((n,), 64.0, device="cuda"))


def bench_fp4(copy_bw: float, sweep_configs: bool) -> list[dict]:
    rows = []
    x_cache: dict[int, torch.Tensor] = {}
    for name, (n, k) in FP4_SHAPES.items():
        nbytes = n * k // 2 + n * k // 16
        copies = [nvfp4_weight(n, k) for _ in range(max(2, (512 << 20) // nbytes))]
        x = x_cache.setdefault(k, torch.randn(1, k, device="cuda", dtype=torch.bfloat16))
        dense = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) for _ in range(max(2, (512 << 20) // (2 * n * k)))]
        us, bf16_us = timed(gemv, copies, x), timed(gemv, dense, x)
        plain_us = timed(lambda xx, w: gemv(xx, w, fp4_mma=0), copies, x)
        ptxas_us = timed(lambda xx, w: gemv(xx, w, maxnreg=0), copies, x)
        row = {"shape": name, "n": n, "k": k, "mb": nbytes / 1e6, "us": us, "frac_of_copy": nbytes / us / 1e3 / copy_bw,
               "ptxas_regs_us": ptxas_us, "ptxas_regs_frac_of_copy": nbytes / ptxas_us / 1e3 / copy_bw,
               "plain_us": plain_us, "plain_frac_of_copy": nbytes / plain_us / 1e3 / copy_bw,
               "bf16_us": bf16_us, "bf16_frac_of_copy": 2 * n * k / bf16_us / 1e3 / copy_bw,
               "config": _config(1, n, k, 4, num_sms(torch.device("cuda")), *[None] * 5, True)}
        if name.endswith("gate_up"):  # with the SwiGLU as its epilogue (one launch, the act written)
            row["swiglu_epilogue_us"] = timed(gemv_swiglu, copies, x)
        del dense
        if sweep_configs:
            row["sweep"] = []
            for bn, bk in ((16, 512), (32, 256), (64, 256), (128, 256)):
                for warps, split, regs in itertools.product((2, 4, 8), (None, 2, 4), (None, 0, 128)):
                    if regs is not None and not fp4_mma_tile(bn, bk, warps):
                        continue
                    cfg = dict(block_n=bn, block_k=bk, num_warps=warps, **({"split_k": split} if split else {}),
                               **({} if regs is None else {"maxnreg": regs}))
                    try:
                        t = timed(lambda xx, w: gemv(xx, w, **cfg), copies, x)
                    except Exception as e:  # noqa: BLE001 - a config the compiler refuses is skipped
                        print("skip", cfg, type(e).__name__)
                        continue
                    row["sweep"].append({**cfg, "mma": fp4_mma_tile(bn, bk, warps), "us": t})
            row["best"] = min(row["sweep"], key=lambda r: r["us"])
        rows.append(row)
        print(f"nvfp4 {name:11s} {row['mb']:5.1f} MB  {us:7.2f} us ({row['frac_of_copy']:.0%} of copy)  "
              f"ptxas regs {ptxas_us:7.2f} us ({row['ptxas_regs_frac_of_copy']:.0%})  "
              f"plain {plain_us:7.2f} us ({row['plain_frac_of_copy']:.0%})  "
              f"bf16 {bf16_us:7.2f} us ({row['bf16_frac_of_copy']:.0%})  config {row['config']}"
              + (f"  with SwiGLU epilogue {row['swiglu_epilogue_us']:7.2f} us" if "swiglu_epilogue_us" in row else "")
              + (f"  best {row['best']}" if sweep_configs else ""))
        del copies
    return rows + bench_moe(copy_bw, sweep_configs)


def bench_moe(copy_bw: float, sweep_configs: bool = False) -> list[dict]:
    """The fused MoE decode path at T = 1 for a Qwen3.5-35B-A3B layer (E 256, H 2048, I 512, top 8), NVFP4:
    per-kernel times from the profiler, 20 graph-replayed calls, each on its own random 8 experts; with
    ``sweep_configs`` also forced (block_n, block_k) (both launches)."""
    from vtcore.kernels.fused_moe import FP4Experts, fused_experts

    e, h, i, k = 256, 2048, 512, 8
    layer = [(e, 2 * i, h), (e, h, i)]
    fp4 = []
    for _ in range(2):  # 2 x 302 MB of experts
        gu_p, d_p = (torch.randint(0, 256, (a, b, c // 2), device="cuda", dtype=torch.uint8) for a, b, c in layer)
        gu_s, d_s = (torch.randint(0x30, 0x40, (a, b, c // 16), device="cuda", dtype=torch.uint8) for a, b, c in layer)
        fp4.append(FP4Experts(gu_p, gu_s, d_p, d_s, "e4m3", 16, torch.full((e, 2), 64.0, device="cuda"),
                              torch.full((e, 1), 64.0, device="cuda")))
    x = torch.randn(1, h, device="cuda", dtype=torch.bfloat16)
    picks = [torch.randperm(e, device="cuda")[:k].to(torch.int32)[None] for _ in range(20)]
    weights = torch.full((1, k), 1.0 / k, device="cuda")
    rows = []
    for cfg in [{}] + ([dict(block_n=8), dict(block_n=8, block_k=512), dict(block_n=32), dict(block_k=512)]
                       if sweep_configs else []):
        calls = [lambda j=j: fused_experts(x, picks[j], weights, None, None, fp4=fp4[j % 2], path="decode", **cfg)
                 for j in range(20)]
        rows += _profile_moe(calls, cfg, copy_bw, k, h, i)
    return rows


def _profile_moe(calls: list, cfg: dict, copy_bw: float, k: int, h: int, i: int) -> list[dict]:
    for c in calls:
        c()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for c in calls:
            c()
    graph.replay()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(5):
            graph.replay()
        torch.cuda.synchronize()
    times: dict[str, list[float]] = {}
    for ev in prof.events():
        if ev.device_type == torch.autograd.DeviceType.CUDA and "decode" in ev.name:
            times.setdefault(ev.name, []).append(ev.device_time)
    nbytes = {"gate_up": k * 2 * i * (h // 2 + h // 16), "down": k * h * (i // 2 + i // 16)}
    rows = []
    for kname, ts in sorted(times.items()):
        which = "gate_up" if "gate_up" in kname else "down"
        us = statistics.median(ts)
        rows.append({"shape": f"35b-a3b moe {which} (8 experts)", "kernel": kname, "mb": nbytes[which] / 1e6, "us": us,
                     "frac_of_copy": nbytes[which] / us / 1e3 / copy_bw, "launches": len(ts), "config": cfg})
        print(f"nvfp4 moe {which:8s} {nbytes[which] / 1e6:5.1f} MB  {us:7.2f} us ({rows[-1]['frac_of_copy']:.0%} of copy)"
              f"  {cfg or 'default blocks'}")
    return rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    ap.add_argument("--sweep", action="store_true")
    ap.add_argument("--fp4", action="store_true")
    args = ap.parse_args()
    copy_bw = copy_bandwidth()
    if args.fp4:
        rows = bench_fp4(copy_bw, args.sweep)
        print(f"copy bandwidth {copy_bw:.0f} GB/s")
        if args.out:
            with open(os.path.join(args.out, "bench_gemv_fp4.json"), "w") as f:
                json.dump({"device": torch.cuda.get_device_name(), "copy_gb_s": copy_bw, "rows": rows}, f, indent=1)
        return
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
            print(f"{'':13s} M= 1 default {_config(1, n, k, 16, num_sms(torch.device('cuda')), *[None] * 5)} "
                  f"{ours_m1:.2f} us; best {best}")
        del copies
    print(f"copy bandwidth {copy_bw:.0f} GB/s")
    if args.out:
        with open(os.path.join(args.out, "bench_gemv.json"), "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "copy_gb_s": copy_bw, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
