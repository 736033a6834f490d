"""Per-head q/k RMSNorm (optional) then rotate-half RoPE, in place in q and k, one launch for both.

:func:`qk_norm_rope_ref` is the torch reference (new tensors; the CPU path of
:class:`vtcore.layers.rotary.RotaryEmbedding`). Program ``(t, 0)`` owns token ``t``'s q heads and
``(t, 1)`` its k heads, each as a [heads, half] tile pair plus the pass-through rest (a few programs
per token: a prefill of 32k tokens is 64k programs, not a million). It normalises each head with one
float32 ``rstd`` (rounding as :mod:`vtcore.kernels.rmsnorm`, whose caveats apply: only the float32
sum of squares is ordered differently from torch), and rotates the first ``rotary_dim`` channels as
the reference does in ``x.dtype``: ``cos``/``sin`` rounded to it, then ``rnd(rnd(x1*c) - rnd(x2*s))``
and ``rnd(rnd(x2*c) + rnd(x1*s))``, each product of two activation-dtype values exact in float32 and
rounded once, as torch rounds each op. With no norm weights the result is bit-identical to torch's.
The pass-through channels are rewritten only when they are normalised. Given the paged cache, the
same program also writes the token's rotated k (program 1) and its v (program 2) to the token's slot
(the decode step's KV write, without a launch of its own). :func:`head_epilogue` is the same work for
one head, as the qkv GEMV's epilogue.
"""
from __future__ import annotations

import functools

import attrs
import torch
import triton
import triton.language as tl

from vtcore.kernels.helpers import INTERPRET, cast, normalize
from vtcore.kernels.pdl import pdl_launch, wait_prior
from vtcore.kernels.rmsnorm import rms_norm_ref

__all__ = ["qk_norm_rope", "qk_norm_rope_ref", "QKRope"]


@attrs.frozen
class QKRope:
    """What :func:`qk_norm_rope` (with the cache write) needs for one decode token, handed to the qkv
    GEMV whose epilogue does that work instead (:func:`vtcore.kernels.gemv.gemv_qk_rope`)."""

    q_heads: int
    kv_heads: int
    head_dim: int
    q_weight: torch.Tensor | None
    k_weight: torch.Tensor | None
    eps: float
    zero_centered: bool
    cos_cache: torch.Tensor
    sin_cache: torch.Tensor
    positions: torch.Tensor
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    slot_mapping: torch.Tensor

    def fits(self, x: torch.Tensor, n: int) -> bool:
        """Whether the epilogue handles a projection of ``x`` (one row) to ``n`` outputs: a head a
        power of two >= 16 wide, RoPE over all of it (float32 caches), one token's position and slot,
        q/k norm weights both or neither in x's dtype, and caches [slots, kv_heads, head_dim] of x's
        dtype in one layout with contiguous heads."""
        hd, kc = self.head_dim, self.k_cache
        weights = (self.q_weight, self.k_weight)
        return (x.shape[0] == 1 and n == (self.q_heads + 2 * self.kv_heads) * hd and hd >= 16 and not hd & (hd - 1)
                and self.cos_cache.shape[1] == hd and self.cos_cache.dtype == self.sin_cache.dtype == torch.float32
                and self.cos_cache.stride() == self.sin_cache.stride() and self.cos_cache.stride(1) == 1
                and self.positions.numel() == 1 and self.slot_mapping.numel() == 1
                and (weights[0] is None) == (weights[1] is None)
                and all(w is None or (w.shape == (hd,) and w.dtype == x.dtype and w.is_contiguous()) for w in weights)
                and kc.dim() == 3 and kc.shape[1:] == (self.kv_heads, hd) and kc.dtype == x.dtype
                and self.v_cache.shape == kc.shape and self.v_cache.stride() == kc.stride() and kc.stride(2) == 1
                and self.v_cache.dtype == kc.dtype)


@triton.jit
def _rotate(x1, x2, c1, c2, s1, s2, DT: tl.constexpr, INTERPRET: tl.constexpr):
    """``x * cos + rotate_half(x) * sin`` with ``rotate_half(x) = (-x2, x1)``, every op rounded to ``DT``
    (float32 halves in, ``DT`` halves out)."""
    a1 = cast(x1 * c1, DT, INTERPRET).to(tl.float32)
    b1 = cast(x2 * s1, DT, INTERPRET).to(tl.float32)
    a2 = cast(x2 * c2, DT, INTERPRET).to(tl.float32)
    b2 = cast(x1 * s2, DT, INTERPRET).to(tl.float32)
    return cast(a1 - b1, DT, INTERPRET), cast(a2 + b2, DT, INTERPRET)


@triton.jit
def _cos_sin(cos_ptr, sin_ptr, cs, j, jm, HALF: tl.constexpr, DT: tl.constexpr, INTERPRET: tl.constexpr):
    """The cos and sin halves at row offset ``cs`` of the float32 caches, rounded to ``DT`` (as
    :func:`qk_norm_rope_ref` rounds them), as float32."""
    c1 = cast(tl.load(cos_ptr + cs + j, mask=jm, other=0.0), DT, INTERPRET).to(tl.float32)
    c2 = cast(tl.load(cos_ptr + cs + HALF + j, mask=jm, other=0.0), DT, INTERPRET).to(tl.float32)
    s1 = cast(tl.load(sin_ptr + cs + j, mask=jm, other=0.0), DT, INTERPRET).to(tl.float32)
    s2 = cast(tl.load(sin_ptr + cs + HALF + j, mask=jm, other=0.0), DT, INTERPRET).to(tl.float32)
    return c1, c2, s1, s2


@triton.jit
def head_epilogue(y, head, out_ptr, pos_ptr, cos_ptr, sin_ptr, stride_cos, qw_ptr, kw_ptr, kc_ptr, vc_ptr, slot_ptr,
                  stride_ct, stride_ch, eps, NQ: tl.constexpr, NKV: tl.constexpr, HEAD_DIM: tl.constexpr,
                  HAS_NORM: tl.constexpr, ZERO_CENTERED: tl.constexpr, DT: tl.constexpr):
    """Head ``head`` of one token's [q | k | v] projection, from ``y``, its HEAD_DIM float32 sums (the
    qkv GEMV's epilogue, :func:`vtcore.kernels.gemv.gemv_qk_rope`): rounded to ``DT`` as the projection
    would be, then q and k heads normed and rotated as :func:`qk_norm_rope` does (full-width RoPE; only
    the float32 sum of squares may be summed in another order) and written to ``out_ptr``'s head; k
    and v heads also go to cache slot ``slot_ptr[0]`` (when negative: none, and the k and v heads are
    written as zeros, as :func:`qk_norm_rope` leaves a padded row).

    Every rounding here is done with integer ops (``cast``'s interpreter path, ``RNE``): the GEMV
    compiles with FP contraction, under which the float conversions' rounding is not kept
    (docs/BENCHMARKS.md, the qkv epilogue)."""
    RNE: tl.constexpr = True
    HALF: tl.constexpr = HEAD_DIM // 2
    j = tl.arange(0, HALF)
    x1, x2 = tl.split(tl.permute(tl.reshape(cast(y, DT, RNE).to(tl.float32), (2, HALF)), (1, 0)))
    dst = out_ptr + head * HEAD_DIM
    slot = tl.load(slot_ptr).to(tl.int64)
    if head < NQ + NKV:
        c1, c2, s1, s2 = _cos_sin(cos_ptr, sin_ptr, tl.load(pos_ptr) * stride_cos, j, j < HALF, HALF, DT, RNE)
        if HAS_NORM:
            q_head = head < NQ
            w1 = tl.where(q_head, tl.load(qw_ptr + j), tl.load(kw_ptr + j)).to(tl.float32)
            w2 = tl.where(q_head, tl.load(qw_ptr + HALF + j), tl.load(kw_ptr + HALF + j)).to(tl.float32)
            rstd = tl.rsqrt((tl.sum(x1 * x1, axis=0) + tl.sum(x2 * x2, axis=0)) * (1.0 / HEAD_DIM) + eps)
            x1 = cast(normalize(x1, rstd, w1, ZERO_CENTERED, DT, RNE), DT, RNE).to(tl.float32)
            x2 = cast(normalize(x2, rstd, w2, ZERO_CENTERED, DT, RNE), DT, RNE).to(tl.float32)
        o1, o2 = _rotate(x1, x2, c1, c2, s1, s2, DT, RNE)
        cache = kc_ptr + slot * stride_ct + (head - NQ) * stride_ch
    else:
        o1, o2 = x1.to(DT), x2.to(DT)
        cache = vc_ptr + slot * stride_ct + (head - NQ - NKV) * stride_ch
    if head >= NQ and slot < 0:
        o1, o2 = tl.zeros([HALF], DT), tl.zeros([HALF], DT)
    tl.store(dst + j, o1)
    tl.store(dst + HALF + j, o2)
    if head >= NQ and slot >= 0:
        tl.store(cache + j, o1)
        tl.store(cache + HALF + j, o2)


@triton.jit
def _norm_rope_heads(x_ptr, stride_h, w_ptr, c1, c2, s1, s2, eps,
                     NH: tl.constexpr, BLOCK_H: tl.constexpr, HEAD_DIM: tl.constexpr, ROT: tl.constexpr,
                     BLOCK_HALF: tl.constexpr, BLOCK_REST: tl.constexpr, HAS_NORM: tl.constexpr,
                     ZERO_CENTERED: tl.constexpr, DT: tl.constexpr, INTERPRET: tl.constexpr):
    """One token's ``NH`` heads at ``x_ptr`` (``stride_h`` apart), normed and rotated in place; returns
    the new (first half, second half, pass-through rest) in ``DT``, [BLOCK_H, ...] each."""
    HALF: tl.constexpr = ROT // 2
    REST: tl.constexpr = HEAD_DIM - ROT
    h = tl.arange(0, BLOCK_H)
    j = tl.arange(0, BLOCK_HALF)
    r = ROT + tl.arange(0, BLOCK_REST)
    hm = (h < NH)[:, None]
    jm = hm & (j < HALF)[None, :]
    rm = hm & (r < HEAD_DIM)[None, :]
    rows = x_ptr + h[:, None] * stride_h
    x1 = tl.load(rows + j[None, :], mask=jm, other=0.0).to(tl.float32)
    x2 = tl.load(rows + HALF + j[None, :], mask=jm, other=0.0).to(tl.float32)
    xr = tl.load(rows + r[None, :], mask=rm, other=0.0)
    if HAS_NORM:
        ss = tl.sum(x1 * x1, axis=1) + tl.sum(x2 * x2, axis=1)
        if REST > 0:
            ss += tl.sum(xr.to(tl.float32) * xr.to(tl.float32), axis=1)
        rstd = tl.rsqrt(ss * (1.0 / HEAD_DIM) + eps)[:, None]
        w1 = tl.load(w_ptr + j, mask=j < HALF, other=0.0).to(tl.float32)[None, :]
        w2 = tl.load(w_ptr + HALF + j, mask=j < HALF, other=0.0).to(tl.float32)[None, :]
        x1 = cast(normalize(x1, rstd, w1, ZERO_CENTERED, DT, INTERPRET), DT, INTERPRET).to(tl.float32)
        x2 = cast(normalize(x2, rstd, w2, ZERO_CENTERED, DT, INTERPRET), DT, INTERPRET).to(tl.float32)
        if REST > 0:
            wr = tl.load(w_ptr + r, mask=r < HEAD_DIM, other=0.0).to(tl.float32)[None, :]
            xr = cast(normalize(xr.to(tl.float32), rstd, wr, ZERO_CENTERED, DT, INTERPRET), DT, INTERPRET)
            tl.store(rows + r[None, :], xr, mask=rm)
    o1, o2 = _rotate(x1, x2, c1, c2, s1, s2, DT, INTERPRET)
    tl.store(rows + j[None, :], o1, mask=jm)
    tl.store(rows + HALF + j[None, :], o2, mask=jm)
    return o1, o2, xr


@triton.jit
def _zero_heads(rows, d, dm, r, rm, BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr, BLOCK_REST: tl.constexpr,
                DT: tl.constexpr):
    """Zeros into one token's heads at ``rows`` (the rotated part ``d`` and the rest ``r``)."""
    tl.store(rows + d[None, :], tl.zeros([BLOCK_H, 2 * BLOCK_HALF], DT), mask=dm)
    tl.store(rows + r[None, :], tl.zeros([BLOCK_H, BLOCK_REST], DT), mask=rm)


@triton.jit
def _qk_norm_rope_kernel(
    q_ptr, k_ptr, v_ptr, qw_ptr, kw_ptr, cos_ptr, sin_ptr, pos_ptr, kc_ptr, vc_ptr, slot_ptr,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_cs, stride_pos, stride_ct, stride_ch,
    eps,
    NQ: tl.constexpr, NKV: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_KV: tl.constexpr,
    HEAD_DIM: tl.constexpr, ROT: tl.constexpr, BLOCK_HALF: tl.constexpr, BLOCK_REST: tl.constexpr,
    HAS_NORM: tl.constexpr, ZERO_CENTERED: tl.constexpr, WRITE_KV: tl.constexpr, INTERPRET: tl.constexpr,
    PDL: tl.constexpr,
):
    """Program ``(t, part)`` of token ``t``: part 0 its q heads, part 1 its k heads (and, ``WRITE_KV``,
    their cache slot), part 2 (``WRITE_KV`` only) copies its v heads into the cache; ``WRITE_KV`` with a
    negative slot: parts 1 and 2 zero the token's k and v heads instead."""
    wait_prior(PDL)
    HALF: tl.constexpr = ROT // 2
    DT: tl.constexpr = q_ptr.dtype.element_ty
    t = tl.program_id(0)
    part = tl.program_id(1)
    h = tl.arange(0, BLOCK_KV)
    hm = (h < NKV)[:, None]
    r = ROT + tl.arange(0, BLOCK_REST)
    rm = hm & (r < HEAD_DIM)[None, :]
    d = tl.arange(0, 2 * BLOCK_HALF)
    dm = hm & (d < ROT)[None, :]
    if part == 2:
        slot = tl.load(slot_ptr + t).to(tl.int64)
        src = v_ptr + t * stride_vt + h[:, None] * stride_vh
        if slot >= 0:
            dst = vc_ptr + slot * stride_ct + h[:, None] * stride_ch
            tl.store(dst + d[None, :], tl.load(src + d[None, :], mask=dm), mask=dm)
            tl.store(dst + r[None, :], tl.load(src + r[None, :], mask=rm), mask=rm)
        else:
            _zero_heads(src, d, dm, r, rm, BLOCK_KV, BLOCK_HALF, BLOCK_REST, v_ptr.dtype.element_ty)
        return
    j = tl.arange(0, BLOCK_HALF)
    jm = j < HALF
    c1, c2, s1, s2 = _cos_sin(cos_ptr, sin_ptr, tl.load(pos_ptr + t * stride_pos) * stride_cs, j, jm, HALF, DT,
                              INTERPRET)
    c1, c2, s1, s2 = c1[None, :], c2[None, :], s1[None, :], s2[None, :]
    if part == 0:
        _norm_rope_heads(q_ptr + t * stride_qt, stride_qh, qw_ptr, c1, c2, s1, s2, eps, NQ, BLOCK_Q, HEAD_DIM, ROT,
                         BLOCK_HALF, BLOCK_REST, HAS_NORM, ZERO_CENTERED, DT, INTERPRET)
    else:
        padded = False
        if WRITE_KV:
            padded = tl.load(slot_ptr + t) < 0
        if padded:  # a padded row: its k zeroed, not rotated (no rotated store of it races the zeros)
            _zero_heads(k_ptr + t * stride_kt + h[:, None] * stride_kh, d, dm, r, rm, BLOCK_KV, BLOCK_HALF,
                        BLOCK_REST, DT)
        else:
            k1, k2, kr = _norm_rope_heads(k_ptr + t * stride_kt, stride_kh, kw_ptr, c1, c2, s1, s2, eps, NKV,
                                          BLOCK_KV, HEAD_DIM, ROT, BLOCK_HALF, BLOCK_REST, HAS_NORM, ZERO_CENTERED,
                                          DT, INTERPRET)
            if WRITE_KV:
                slot = tl.load(slot_ptr + t).to(tl.int64)
                jm2 = hm & jm[None, :]
                dst = kc_ptr + slot * stride_ct + h[:, None] * stride_ch
                tl.store(dst + j[None, :], k1, mask=jm2)
                tl.store(dst + HALF + j[None, :], k2, mask=jm2)
                tl.store(dst + r[None, :], kr, mask=rm)


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
    of token ``t`` go to cache slot ``slot_mapping[t]``; a token whose slot is negative (a padded row) is
    cached nowhere and its k and v are zeroed in place, as ``write_kv_cache`` does.
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
    if t == 0:
        return q, k
    block_q, block_kv = triton.next_power_of_2(nq), triton.next_power_of_2(nkv)
    _qk_norm_rope_kernel[(t, 3 if write_kv else 2)](
        q, k, vv, q_weight if has_norm else q, k_weight if has_norm else q, cos_cache, sin_cache, positions,
        kc, vc, slots,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), vv.stride(0), vv.stride(1), cos_cache.stride(0),
        positions.stride(0), kc.stride(0), kc.stride(1), eps,
        NQ=nq, NKV=nkv, BLOCK_Q=block_q, BLOCK_KV=block_kv, HEAD_DIM=head_dim, ROT=rotary_dim,
        BLOCK_HALF=block_half, BLOCK_REST=block_rest, HAS_NORM=has_norm, ZERO_CENTERED=zero_centered,
        WRITE_KV=write_kv, INTERPRET=INTERPRET,
        num_warps=min(8, max(1, block_q * block_half // 256)), enable_fp_fusion=False, **pdl_launch(q.device),
    )
    return q, k



def qk_norm_rope_ref(q: torch.Tensor, k: torch.Tensor, q_weight: torch.Tensor | None, k_weight: torch.Tensor | None,
                     eps: float, cos_cache: torch.Tensor, sin_cache: torch.Tensor, positions: torch.Tensor,
                     rotary_dim: int, zero_centered: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Torch reference of :func:`qk_norm_rope` without the cache write (new tensors, any head
    layout): per-head RMSNorm (when weights are given), then HF's rotate-half RoPE in ``q.dtype``."""
    if q_weight is not None:
        q, k = rms_norm_ref(q, q_weight, eps, zero_centered), rms_norm_ref(k, k_weight, eps, zero_centered)
    cos = cos_cache[positions].unsqueeze(1).to(q.dtype)
    sin = sin_cache[positions].unsqueeze(1).to(q.dtype)
    return _apply_rotary(q, cos, sin, rotary_dim), _apply_rotary(k, cos, sin, rotary_dim)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def _apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, d: int) -> torch.Tensor:
    """HF's rotate-half RoPE on the first ``d`` channels of each head (``cos``/``sin`` in ``x``'s dtype)."""
    if d == x.shape[-1]:
        return x * cos + _rotate_half(x) * sin
    rot, rest = x[..., :d], x[..., d:]
    return torch.cat((rot * cos + _rotate_half(rot) * sin, rest), dim=-1)
