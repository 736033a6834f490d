"""Per-head q/k RMSNorm (optional) then rotate-half RoPE, in place in q and k, one launch for both.

Program ``(t, h)`` owns head ``h`` of token ``t`` (q heads first, then k heads). It loads the
head's two rotated halves and the pass-through rest as three contiguous vectors, normalises them
with one float32 ``rstd`` (rounding as :mod:`vtcore.kernels.rmsnorm`, whose caveats apply: only the
float32 sum of squares is ordered differently from torch), and rotates the first ``rotary_dim``
channels as :class:`vtcore.layers.rotary.RotaryEmbedding` does in ``x.dtype``: ``cos``/``sin``
rounded to it, then ``rnd(rnd(x1*c) - rnd(x2*s))`` and ``rnd(rnd(x2*c) + rnd(x1*s))``, each
product of two activation-dtype values exact in float32 and rounded once, as torch rounds each op.
With no norm weights the result is bit-identical to torch's. The pass-through channels are
rewritten only when they are normalised.
"""
from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from vtcore.kernels.rmsnorm import INTERPRET, _cast, _normalize
from vtcore.layers.rotary import qk_norm_rope_torch

__all__ = ["qk_norm_rope", "qk_norm_rope_ref"]


@triton.jit
def _qk_norm_rope_kernel(
    q_ptr, k_ptr, v_ptr, qw_ptr, kw_ptr, cos_ptr, sin_ptr, pos_ptr, kc_ptr, vc_ptr, slot_ptr,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_cs, stride_pos, stride_ct, stride_ch,
    eps,
    NQ: tl.constexpr,
    NKV: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    ROT: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
    BLOCK_REST: tl.constexpr,
    HAS_NORM: tl.constexpr,
    ZERO_CENTERED: tl.constexpr,
    WRITE_KV: tl.constexpr,
    INTERPRET: tl.constexpr,
):
    HALF: tl.constexpr = ROT // 2
    REST: tl.constexpr = HEAD_DIM - ROT
    DT: tl.constexpr = q_ptr.dtype.element_ty
    t = tl.program_id(0)
    h = tl.program_id(1)
    j = tl.arange(0, BLOCK_HALF)
    jm = j < HALF
    r = ROT + tl.arange(0, BLOCK_REST)
    rm = r < HEAD_DIM
    if WRITE_KV:
        slot = tl.load(slot_ptr + t).to(tl.int64)
        if h >= NQ + NKV:  # a v head: straight into the cache
            if slot >= 0:
                d = tl.arange(0, 2 * BLOCK_HALF)
                src = v_ptr + t * stride_vt + (h - NQ - NKV) * stride_vh
                dst = vc_ptr + slot * stride_ct + (h - NQ - NKV) * stride_ch
                tl.store(dst + d, tl.load(src + d, mask=d < ROT), mask=d < ROT)
                if REST > 0:
                    tl.store(dst + r, tl.load(src + r, mask=rm), mask=rm)
            return
    if h < NQ:
        x_ptr = q_ptr + t * stride_qt + h * stride_qh
        w_ptr = qw_ptr
    else:
        x_ptr = k_ptr + t * stride_kt + (h - NQ) * stride_kh
        w_ptr = kw_ptr
    x1 = tl.load(x_ptr + j, mask=jm, other=0.0).to(tl.float32)
    x2 = tl.load(x_ptr + HALF + j, mask=jm, other=0.0).to(tl.float32)
    if REST > 0:
        xr = tl.load(x_ptr + r, mask=rm, other=0.0)
    if HAS_NORM:
        ss = tl.sum(x1 * x1, axis=0) + tl.sum(x2 * x2, axis=0)
        if REST > 0:
            ss += tl.sum(xr.to(tl.float32) * xr.to(tl.float32), axis=0)
        rstd = tl.rsqrt(ss * (1.0 / HEAD_DIM) + eps)
        w1 = tl.load(w_ptr + j, mask=jm, other=0.0).to(tl.float32)
        w2 = tl.load(w_ptr + HALF + j, mask=jm, other=0.0).to(tl.float32)
        x1 = _cast(_normalize(x1, rstd, w1, ZERO_CENTERED, DT, INTERPRET), DT, INTERPRET).to(tl.float32)
        x2 = _cast(_normalize(x2, rstd, w2, ZERO_CENTERED, DT, INTERPRET), DT, INTERPRET).to(tl.float32)
        if REST > 0:
            wr = tl.load(w_ptr + r, mask=rm, other=0.0).to(tl.float32)
            xr = _cast(_normalize(xr.to(tl.float32), rstd, wr, ZERO_CENTERED, DT, INTERPRET), DT, INTERPRET)
            tl.store(x_ptr + r, xr, mask=rm)
    cs = tl.load(pos_ptr + t * stride_pos) * stride_cs
    c1 = _cast(tl.load(cos_ptr + cs + j, mask=jm, other=0.0), DT, INTERPRET).to(tl.float32)
    c2 = _cast(tl.load(cos_ptr + cs + HALF + j, mask=jm, other=0.0), DT, INTERPRET).to(tl.float32)
    s1 = _cast(tl.load(sin_ptr + cs + j, mask=jm, other=0.0), DT, INTERPRET).to(tl.float32)
    s2 = _cast(tl.load(sin_ptr + cs + HALF + j, mask=jm, other=0.0), DT, INTERPRET).to(tl.float32)
    # x * cos + rotate_half(x) * sin, rotate_half(x) = (-x2, x1); every op rounded to DT
    a1 = _cast(x1 * c1, DT, INTERPRET).to(tl.float32)
    b1 = _cast(x2 * s1, DT, INTERPRET).to(tl.float32)
    a2 = _cast(x2 * c2, DT, INTERPRET).to(tl.float32)
    b2 = _cast(x1 * s2, DT, INTERPRET).to(tl.float32)
    o1 = _cast(a1 - b1, DT, INTERPRET)
    o2 = _cast(a2 + b2, DT, INTERPRET)
    tl.store(x_ptr + j, o1, mask=jm)
    tl.store(x_ptr + HALF + j, o2, mask=jm)
    if WRITE_KV:
        if h >= NQ and slot >= 0:  # a k head: the rotated head into the cache too
            dst = kc_ptr + slot * stride_ct + (h - NQ) * stride_ch
            tl.store(dst + j, o1, mask=jm)
            tl.store(dst + HALF + j, o2, mask=jm)
            if REST > 0:
                tl.store(dst + r, xr, mask=rm)


@functools.cache
def _blocks(head_dim: int, rotary_dim: int) -> tuple[int, int]:
    """(BLOCK_HALF, BLOCK_REST): powers of two covering rotary_dim / 2 and head_dim - rotary_dim."""
    return triton.next_power_of_2(rotary_dim // 2), triton.next_power_of_2(max(1, head_dim - rotary_dim))


def qk_norm_rope(q: torch.Tensor, k: torch.Tensor, q_weight: torch.Tensor | None, k_weight: torch.Tensor | None,
                 eps: float, cos_cache: torch.Tensor, sin_cache: torch.Tensor, positions: torch.Tensor,
                 rotary_dim: int, zero_centered: bool = False, *, v: torch.Tensor | None = None,
                 k_cache: torch.Tensor | None = None, v_cache: torch.Tensor | None = None,
                 slot_mapping: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """In place: ``q`` [tokens, heads, head_dim] and ``k`` [tokens, kv_heads, head_dim] become
    ``rope(rms_norm(x, weight))`` per head (returned for convenience: the same tensors).

    Token and head strides of ``q``/``k`` are honoured (views into a fused qkv output); the last dim
    must be contiguous. ``q_weight``/``k_weight`` [head_dim], in ``q.dtype``: both given, or both None
    (no norm, as Llama). ``cos_cache``/``sin_cache``: float32 [max_position, rotary_dim], the same
    layout; ``positions`` [tokens], any integer dtype and stride; ``rotary_dim`` even, <= head_dim.

    With ``v``, ``k_cache``, ``v_cache`` and ``slot_mapping`` (all or none) it also does
    :func:`vtcore.kernels.paged_attention.write_kv_cache` in the same launch: the rotated k and v
    of token ``t`` go to cache slot ``slot_mapping[t]`` (skipped when negative).
    """
    t, nq, head_dim = q.shape
    nkv = k.shape[1]
    has_norm = q_weight is not None
    if has_norm != (k_weight is not None):
        raise ValueError("q_weight and k_weight: give both or neither")
    cache = (v, k_cache, v_cache, slot_mapping)
    write_kv = v is not None
    if any((c is None) == write_kv for c in cache):
        raise ValueError("v, k_cache, v_cache and slot_mapping: give all or none")
    if write_kv and (v.shape != k.shape or k_cache.shape[1:] != (nkv, head_dim) or v_cache.stride() != k_cache.stride()
                     or k_cache.dtype != q.dtype or v.stride(-1) != 1 or k_cache.stride(-1) != 1):
        raise ValueError(f"qk_norm_rope: v {tuple(v.shape)}, k_cache {tuple(k_cache.shape)} {k_cache.dtype}: expected "
                         f"v shaped like k {tuple(k.shape)} and caches [slots, {nkv}, {head_dim}] of {q.dtype}, one "
                         "layout, last dims contiguous")
    block_half, block_rest = _blocks(head_dim, rotary_dim)
    kc, vc, slots, vv = (k_cache, v_cache, slot_mapping, v) if write_kv else (q, q, positions, q)
    _qk_norm_rope_kernel[(t, nq + nkv + (nkv if write_kv else 0))](
        q, k, vv, q_weight if has_norm else q, k_weight if has_norm else q, cos_cache, sin_cache, positions,
        kc, vc, slots,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), vv.stride(0), vv.stride(1), cos_cache.stride(0),
        positions.stride(0), kc.stride(0), kc.stride(1), eps,
        NQ=nq, NKV=nkv, HEAD_DIM=head_dim, ROT=rotary_dim, BLOCK_HALF=block_half, BLOCK_REST=block_rest,
        HAS_NORM=has_norm, ZERO_CENTERED=zero_centered, WRITE_KV=write_kv, INTERPRET=INTERPRET,
        num_warps=1, enable_fp_fusion=False,
    )
    return q, k


qk_norm_rope_ref = qk_norm_rope_torch
