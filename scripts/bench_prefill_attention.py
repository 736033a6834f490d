"""Prefill attention on one GPU: vtcore's paged Triton kernel beside torch's SDPA (flash) on the same shapes.

    python scripts/bench_prefill_attention.py [--sweep] [--out DIR]
Qwen3-4B heads (32 query, 8 kv, head_dim 128), bf16, paged cache of 16-token blocks in shuffled order.
Cases: a whole prompt of 1024 and of 8192 tokens (causal), and a 128-token chunk after a 2048-token cached
prefix (issue 21's hit). One call per "layer" over separate caches (36, or 8 for the 8192 prompt), captured
in a CUDA graph, median of 5 replays; microseconds per call and the causal attention's TFLOP/s
(``4 * heads * head_dim * sum of visible keys``). The peer: ``torch.nn.functional.scaled_dot_product_attention``
with ``is_causal`` on contiguous [1, heads, tokens, head_dim] tensors (whole prompts only; its causal mask
is top-left aligned, which a chunk after a prefix is not). ``--sweep`` forces (block_m, block_n, num_warps,
num_stages, num_splits). ``--alternatives`` adds, per case, the same kernel over a contiguous cache (one
block holding the whole context: what paging costs) and FlashAttention-2 (``aten._flash_attention_forward``,
varlen, GQA native, bottom-right causal) over contiguous K/V, and with the paged cache gathered first, and,
for whole prompts, SDPA with its flash and its cuDNN backend forced (K/V expanded to the query heads), and
the engine's own from-zero call (``vtcore.layers.attention.causal_attention``) over q/k/v as a layer hands
them over (views of one fused qkv row, strided), with the SDPA kernel it ran (torch.profiler).
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import torch
import triton
from torch.nn.attention import SDPBackend, sdpa_kernel

from vtcore.kernels.paged_attention import paged_prefill_attention, prefill_num_splits
from vtcore.layers.attention import causal_attention

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_gemv import replay_us  # noqa: E402

HEADS, KV_HEADS, HEAD_DIM, BLOCK = 32, 8, 128, 16
CASES = ((1024, 1024, 36), (128, 2176, 36), (8192, 8192, 8))  # (query tokens, context, layers)
SWEEP = [(bm, bn, w, s) for bm in (64, 128) for bn in (64, 128) for w in (4, 8) for s in (2, 3)
         if not (bm == 128 and bn == 128 and s == 3)]


def case(qlen: int, ctx: int, layers: int) -> tuple:
    blocks = -(-ctx // BLOCK)
    g = torch.Generator().manual_seed(qlen * 100003 + ctx)
    caches = [(torch.randn(blocks * BLOCK, KV_HEADS, HEAD_DIM, generator=g).to("cuda", torch.bfloat16),
               torch.randn(blocks * BLOCK, KV_HEADS, HEAD_DIM, generator=g).to("cuda", torch.bfloat16))
              for _ in range(layers)]
    table = torch.randperm(blocks, generator=g).view(1, blocks).to("cuda", torch.int32)
    qsl = torch.tensor([0, qlen], dtype=torch.int32, device="cuda")
    lens = torch.tensor([ctx], dtype=torch.int32, device="cuda")
    q = torch.randn(qlen, HEADS, HEAD_DIM, generator=g).to("cuda", torch.bfloat16)
    return caches, table, qsl, lens, q


def flops(qlen: int, ctx: int) -> int:
    visible = sum(ctx - qlen + i + 1 for i in range(qlen))
    return 4 * HEADS * HEAD_DIM * visible


def timed(c: tuple, qlen: int, ctx: int, **kw) -> float:
    caches, table, qsl, lens, q = c
    out = torch.empty_like(q)

    def run() -> None:
        for k, v in caches:
            paged_prefill_attention(q, k, v, table, qsl, lens, HEAD_DIM ** -0.5, BLOCK, qlen, ctx, out, **kw)
    return replay_us(run, len(caches))


def alternatives(c: tuple, qlen: int, ctx: int) -> dict[str, float]:
    """Microseconds a layer of the contiguous-cache kernel and of FlashAttention-2, contiguous and gathered."""
    caches, table, qsl, lens, q = c
    out, scale = torch.empty_like(q), HEAD_DIM ** -0.5
    slots = (table[0].long()[:, None] * BLOCK + torch.arange(BLOCK, device="cuda")).reshape(-1)[:ctx]
    span = triton.next_power_of_2(ctx)
    contiguous = []
    for k, v in caches:
        kc, vc = (torch.zeros(span, KV_HEADS, HEAD_DIM, dtype=k.dtype, device="cuda") for _ in range(2))
        kc[:ctx], vc[:ctx] = k[slots], v[slots]
        contiguous.append((kc, vc))
    one_block = torch.zeros(1, 1, dtype=torch.int32, device="cuda")
    cu_k = torch.tensor([0, ctx], dtype=torch.int32, device="cuda")

    def flash(k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return torch.ops.aten._flash_attention_forward(q, k, v, qsl, cu_k, qlen, ctx, 0.0, True, False,
                                                       scale=scale)[0]

    def run_contiguous() -> None:
        for kc, vc in contiguous:
            paged_prefill_attention(q, kc, vc, one_block, qsl, lens, scale, span, qlen, ctx, out)

    def run_flash() -> None:
        for kc, vc in contiguous:
            flash(kc[:ctx], vc[:ctx])

    def run_gathered() -> None:
        for k, v in caches:
            flash(k.index_select(0, slots), v.index_select(0, slots))
    layers = len(caches)
    return {"contiguous_us": replay_us(run_contiguous, layers), "flash2_us": replay_us(run_flash, layers),
            "flash2_gathered_us": replay_us(run_gathered, layers)}


def sdpa_us(qlen: int, layers: int, backend: SDPBackend | None = None) -> float | None:
    """SDPA over a whole causal prompt: torch's own choice of backend, or ``backend`` forced (K/V expanded to
    the query heads, which every backend takes); None where the forced backend refuses the shape."""
    g = torch.Generator().manual_seed(7)
    qs = torch.randn(1, HEADS, qlen, HEAD_DIM, generator=g).to("cuda", torch.bfloat16)
    kvs = [(torch.randn(1, KV_HEADS, qlen, HEAD_DIM, generator=g).to("cuda", torch.bfloat16),
            torch.randn(1, KV_HEADS, qlen, HEAD_DIM, generator=g).to("cuda", torch.bfloat16)) for _ in range(layers)]
    if backend is not None:
        kvs = [(k.repeat_interleave(HEADS // KV_HEADS, 1), v.repeat_interleave(HEADS // KV_HEADS, 1)) for k, v in kvs]

    def run() -> None:
        for k, v in kvs:
            torch.nn.functional.scaled_dot_product_attention(qs, k, v, is_causal=True, enable_gqa=backend is None)
    if backend is None:
        return replay_us(run, layers)
    try:
        with sdpa_kernel(backend):
            return replay_us(run, layers)
    except RuntimeError:
        return None


def engine_call_us(qlen: int, layers: int) -> dict[str, object]:
    """``causal_attention`` over views of a fused qkv row per layer (the engine's from-zero call), and the
    names of the kernels one call launched."""
    g = torch.Generator().manual_seed(11)
    width = (HEADS + 2 * KV_HEADS) * HEAD_DIM
    views = []
    for _ in range(layers):
        qkv = torch.randn(qlen, width, generator=g).to("cuda", torch.bfloat16)
        views.append((qkv[:, :HEADS * HEAD_DIM].view(qlen, HEADS, HEAD_DIM),
                      qkv[:, HEADS * HEAD_DIM:(HEADS + KV_HEADS) * HEAD_DIM].view(qlen, KV_HEADS, HEAD_DIM),
                      qkv[:, (HEADS + KV_HEADS) * HEAD_DIM:].view(qlen, KV_HEADS, HEAD_DIM)))

    def run() -> None:
        for q, k, v in views:
            causal_attention(q, k, v, HEAD_DIM ** -0.5).reshape(qlen, -1)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        causal_attention(*views[0], HEAD_DIM ** -0.5).reshape(qlen, -1)
        torch.cuda.synchronize()
    kernels = sorted({e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA})
    return {"engine_call_us": replay_us(run, layers), "engine_call_kernels": kernels}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sweep", action="store_true")
    ap.add_argument("--alternatives", action="store_true")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    rows = []
    for qlen, ctx, layers in CASES:
        c = case(qlen, ctx, layers)
        f = flops(qlen, ctx)
        us = timed(c, qlen, ctx)
        splits = prefill_num_splits(qlen, HEADS, 1, ctx, torch.device("cuda"))
        peer = sdpa_us(qlen, layers) if qlen == ctx else None
        rows.append({"qlen": qlen, "ctx": ctx, "config": "default", "splits": splits, "us": us,
                     "tflops": f / us / 1e6, "sdpa_us": peer})
        print(f"q {qlen:5d} over {ctx:5d}: {us:8.2f} us ({f / us / 1e6:6.1f} TFLOP/s, splits {splits})"
              + ("" if peer is None else f"; SDPA {peer:8.2f} us ({f / peer / 1e6:6.1f} TFLOP/s)"), flush=True)
        if args.alternatives:
            rows[-1].update(alternatives(c, qlen, ctx))
            if qlen == ctx:
                rows[-1].update({f"sdpa_{b.name.lower()}_us": sdpa_us(qlen, layers, b)
                                 for b in (SDPBackend.FLASH_ATTENTION, SDPBackend.CUDNN_ATTENTION)})
                rows[-1].update(engine_call_us(qlen, layers))
            print("    " + ", ".join(f"{k} {v}" if v is None else f"{k} {v:.2f}"
                                  for k, v in rows[-1].items() if k.endswith("_us")), flush=True)
            if "engine_call_kernels" in rows[-1]:
                print(f"    engine call's kernels: {rows[-1]['engine_call_kernels']}", flush=True)
        if args.sweep:
            split_choices = (1,) if qlen == ctx else (1, 4)
            for bm, bn, w, s in SWEEP:
                for sp in split_choices:
                    try:
                        t = timed(c, qlen, ctx, block_m=bm, block_n=bn, num_warps=w, num_stages=s, num_splits=sp)
                    except Exception as exc:  # noqa: BLE001 - a config that does not fit (shared memory)
                        print(f"    {bm, bn, w, s, sp}: {type(exc).__name__}", flush=True)
                        continue
                    rows.append({"qlen": qlen, "ctx": ctx, "config": [bm, bn, w, s, sp], "us": t,
                                 "tflops": f / t / 1e6})
            best = sorted((r for r in rows if r["qlen"] == qlen and r["config"] != "default"),
                          key=lambda r: r["us"])[:5]
            for r in best:
                print(f"    block_m, block_n, warps, stages, splits {r['config']}: {r['us']:.2f} us "
                      f"({r['tflops']:.1f} TFLOP/s)", flush=True)
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "bench_prefill_attention.json"), "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
