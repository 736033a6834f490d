"""Paged attention: KV-cache writes, decode (split-KV) and varlen causal prefill, in Triton.

The cache of a layer is ``k_cache``/``v_cache`` ``[num_slots, kv_heads, head_dim]``; position
``p`` of sequence ``b`` lives in slot ``block_tables[b, p // block_size] * block_size +
p % block_size``. Query head ``h`` reads kv head ``h // (heads // kv_heads)`` (GQA).

Every launch is sized from host ints only (shapes, ``max_query_len``, ``max_context_len``), never
from tensor values, so the wrappers neither sync nor break CUDA-graph capture; lengths are read on
the device and programs with nothing to do return at once. Accumulation is float32 with a fixed
order (atomics only count arrivals, see :mod:`vtcore.kernels.workspace`), so results are
deterministic. Softmax runs in base 2 with ``scale * log2(e)``
folded into the scores.

The ``*_ref`` functions are the plain torch versions (float32 softmax through
``F.scaled_dot_product_attention``, vectorised over sequences by padding to the host-int maxima):
the oracle of the kernels and the CPU path of the engine. Only ``write_kv_cache_ref`` syncs on
CUDA (boolean masking).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch.nn import functional as F

from vtcore.kernels.device import num_sms
from vtcore.kernels.pdl import pdl_launch, wait_prior
from vtcore.kernels.workspace import arrival_counters

__all__ = [
    "write_kv_cache", "paged_decode_attention", "paged_prefill_attention", "decode_num_splits", "prefill_num_splits",
    "write_kv_cache_ref", "paged_decode_attention_ref", "paged_prefill_attention_ref",
]

_LOG2E = 1.4426950408889634
_BLOCK_N = 64  # decode key tile (positions)
_PREFILL_BLOCK_M = 64  # prefill query rows a program
_PREFILL_BLOCK_N = 64  # prefill key tile (positions)
# Prefill key splits (paged_prefill_attention's num_splits): aimed at this many programs an SM, each split
# with at least this many key tiles, at most this many splits (partials cost 8 bytes a head-dim value a split)
_PREFILL_PROGRAMS_PER_SM = 2
_PREFILL_MIN_TILES = 4
_PREFILL_MAX_SPLITS = 8
#: the prefill's running-max start: finite, so a row that has seen no key yet stays free of NaN
_M_FLOOR = tl.constexpr(-1.0e30)
_TARGET_PROGRAMS = 1024  # decode programs (seqs x kv_heads x splits) the heuristic aims for
_MAX_SPLITS = 32  # ... but no more splits than this (programs past the context still cost their start)
# Early reads (paged_decode_attention's early_reads) only for grids of at most this many programs an SM (one
# wave: the kernel holds ~200 registers a thread, two programs an SM); beyond, they cost more than they
# overlap (docs/BENCHMARKS.md).
_EARLY_PROGRAMS_PER_SM = 2
_COMBINE_VALUES = 8192  # partial values (heads x splits x head_dim) the last-arriving program loads at once


# ----------------------------------------------------------------------------- cache write


@triton.jit
def _write_kv_kernel(
    k_ptr, v_ptr, kc_ptr, vc_ptr, slot_ptr,
    stride_kt, stride_kh, stride_kd,
    stride_vt, stride_vh, stride_vd,
    stride_cs, stride_ch, stride_cd,
    KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
):
    t = tl.program_id(0)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    mask = (offs_h < KV_HEADS)[:, None] & (offs_d < HEAD_DIM)[None, :]
    k_rows = k_ptr + t * stride_kt + offs_h[:, None] * stride_kh + offs_d[None, :] * stride_kd
    v_rows = v_ptr + t * stride_vt + offs_h[:, None] * stride_vh + offs_d[None, :] * stride_vd
    if slot < 0:  # a padded row: cached nowhere, its k and v zeroed
        tl.store(k_rows, tl.zeros([BLOCK_H, BLOCK_D], k_ptr.dtype.element_ty), mask=mask)
        tl.store(v_rows, tl.zeros([BLOCK_H, BLOCK_D], v_ptr.dtype.element_ty), mask=mask)
        return
    dst = slot * stride_cs + offs_h[:, None] * stride_ch + offs_d[None, :] * stride_cd
    tl.store(kc_ptr + dst, tl.load(k_rows, mask=mask).to(kc_ptr.dtype.element_ty), mask=mask)
    tl.store(vc_ptr + dst, tl.load(v_rows, mask=mask).to(vc_ptr.dtype.element_ty), mask=mask)


def write_kv_cache(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                   slot_mapping: torch.Tensor) -> None:
    """``k_cache[slot_mapping[t]] = k[t]`` (same for v) for every token ``t`` whose slot is >= 0.

    ``k``/``v`` [tokens, kv_heads, head_dim], any strides (views into a fused qkv output are fine);
    ``slot_mapping`` [tokens] int64; a token whose slot is negative (a padded row of a graph batch) is
    cached nowhere and its ``k`` and ``v`` rows are zeroed in place: attention over a step's own K/V
    (``vtcore.layers.attention.causal_attention``) reads padded keys through masked products, where a
    NaN a layer left in a padded row would reach the real rows. The caches must share one layout.
    """
    tokens, kv_heads, head_dim = k.shape
    if tokens == 0:
        return
    _write_kv_kernel[(tokens,)](
        k, v, k_cache, v_cache, slot_mapping,
        k.stride(0), k.stride(1), k.stride(2),
        v.stride(0), v.stride(1), v.stride(2),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        KV_HEADS=kv_heads, HEAD_DIM=head_dim,
        BLOCK_H=triton.next_power_of_2(kv_heads), BLOCK_D=triton.next_power_of_2(head_dim),
    )


# ----------------------------------------------------------------------------- shared tile step


@triton.jit
def _kv_offsets(kv_head_off, block, pos, offs_d, stride_cs, stride_cd, BLOCK_SIZE: tl.constexpr):
    """Cache offsets [BLOCK_N, D] of positions ``pos`` held in cache blocks ``block``."""
    return kv_head_off + (block * BLOCK_SIZE + pos % BLOCK_SIZE)[:, None] * stride_cs + offs_d[None, :] * stride_cd


@triton.jit
def _table_blocks(bt_row, pos, max_blocks, BLOCK_SIZE: tl.constexpr):
    """int64 cache blocks of positions ``pos`` from a block-table row, unmasked: the index is clamped
    to the row's ``max_blocks`` entries (past the context, any valid entry does)."""
    return tl.load(bt_row + tl.minimum(pos // BLOCK_SIZE, max_blocks - 1)).to(tl.int64)


@triton.jit
def _attend_tile(
    q, acc, m_i, l_i, k_ptr, v_ptr, bt_row_ptr, kv_head_off, start, key_end, q_pos, scale_log2,
    stride_cs, stride_cd, offs_n, offs_d, d_mask,
    BLOCK_SIZE: tl.constexpr, BOUNDED: tl.constexpr, CAUSAL: tl.constexpr, DOT_PRECISION: tl.constexpr,
    EARLY_V: tl.constexpr = False, block=None, k_tile=None, v_tile=None,
):
    """One online-softmax step of rows ``q`` [R, D] over key positions ``start + offs_n``.

    ``BOUNDED``: positions >= ``key_end`` are masked (and not loaded); ``CAUSAL``: so are those
    above the row's position ``q_pos`` [R] (read only then). Callers guarantee every row sees at least one key in
    its first tile, so the running max is finite and no ``-inf - -inf`` arises. ``EARLY_V`` issues the
    V load beside K's (decode: one tile a program, latency-bound; prefill keeps V's registers free
    until the scores are done). ``block``: the positions' cache blocks when the caller loaded them
    (int64 [BLOCK_N]; any value where masked), else loaded here. ``k_tile``, ``v_tile``: the tile's K
    and V when the caller loaded them (``block`` then unused), else loaded here.
    """
    pos = start + offs_n
    if BOUNDED:
        n_mask = pos < key_end
    if k_tile is not None:
        k = k_tile
        v = v_tile
    else:
        if BOUNDED:
            if block is None:
                block = tl.load(bt_row_ptr + pos // BLOCK_SIZE, mask=n_mask, other=0).to(tl.int64)
            kv_mask = n_mask[:, None] & d_mask[None, :]
        else:
            if block is None:
                block = tl.load(bt_row_ptr + pos // BLOCK_SIZE).to(tl.int64)
            kv_mask = d_mask[None, :]
        kv_off = _kv_offsets(kv_head_off, block, pos, offs_d, stride_cs, stride_cd, BLOCK_SIZE)
        k = tl.load(k_ptr + kv_off, mask=kv_mask, other=0.0)
        if EARLY_V:
            v = tl.load(v_ptr + kv_off, mask=kv_mask, other=0.0)
    s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * scale_log2
    if BOUNDED:
        s = tl.where(n_mask[None, :], s, float("-inf"))
    if CAUSAL:
        s = tl.where(pos[None, :] <= q_pos[:, None], s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new[:, None])
    if not EARLY_V and k_tile is None:
        v = tl.load(v_ptr + kv_off, mask=kv_mask, other=0.0)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
    return acc, m_new, l_i * alpha + tl.sum(p, 1)


# ----------------------------------------------------------------------------- decode


@triton.jit
def _combine_splits(part_ptr, ml_ptr, n, stride_ph, stride_pk, stride_mh, stride_mk, offs_g, g_mask, offs_d, d_mask,
                    CHUNK: tl.constexpr):
    """The heads ``offs_g`` of one sequence from their first ``n`` split partials:
    ``sum_s w_s acc_s / sum_s w_s l_s``, ``w_s = 2^(m_s - max m)``, splits in index order; all heads
    and CHUNK splits per load, with a running max across chunks (an empty split, max -inf, weighs
    0). Loads bypass L1 (``.cg``): other programs wrote the partials."""
    offs_k = tl.arange(0, CHUNK)
    m_run = tl.full(offs_g.shape, float("-inf"), dtype=tl.float32)
    l_run = tl.zeros(offs_g.shape, dtype=tl.float32)
    acc = tl.zeros((offs_g.shape[0], offs_d.shape[0]), dtype=tl.float32)
    for k0 in range(0, n, CHUNK):
        mask = g_mask[:, None] & (k0 + offs_k < n)[None, :]
        ml = ml_ptr + offs_g[:, None] * stride_mh + (k0 + offs_k)[None, :] * stride_mk
        m = tl.load(ml, mask=mask, other=float("-inf"), cache_modifier=".cg")
        l_s = tl.load(ml + 1, mask=mask, other=0.0, cache_modifier=".cg")
        a = tl.load(part_ptr + offs_g[:, None, None] * stride_ph + (k0 + offs_k)[None, :, None] * stride_pk
                    + offs_d[None, None, :], mask=mask[:, :, None] & d_mask[None, None, :], other=0.0,
                    cache_modifier=".cg")
        m_new = tl.maximum(m_run, tl.max(m, 1))
        m_ref = tl.where(m_new > float("-inf"), m_new, 0.0)  # nothing seen yet: no -inf - -inf
        alpha = tl.exp2(m_run - m_ref)
        w = tl.exp2(m - m_ref[:, None])
        l_run = l_run * alpha + tl.sum(w * l_s, 1)
        acc = acc * alpha[:, None] + tl.sum(w[:, :, None] * a, 1)
        m_run = m_new
    return acc / tl.where(l_run > 0, l_run, 1.0)[:, None]


@triton.jit(do_not_specialize=["num_splits", "max_blocks", "stride_bt", "stride_ms", "stride_mh"])
def _decode_kernel(
    q_ptr, k_ptr, v_ptr, bt_ptr, lens_ptr, out_ptr, part_ptr, ml_ptr, sem_ptr,
    scale_log2, num_splits, max_blocks,
    stride_qs, stride_qh, stride_qd,
    stride_cs, stride_ch, stride_cd,
    stride_bt,
    stride_os, stride_oh, stride_od,
    stride_ps, stride_ph, stride_pk,
    stride_ms, stride_mh, stride_mk,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    BLOCK_G: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, GROUP_P2: tl.constexpr,
    CHUNK: tl.constexpr, SPLIT_OUT: tl.constexpr, DOT_PRECISION: tl.constexpr, PDL: tl.constexpr,
    EARLY: tl.constexpr,
):
    """Program (split, kv head, seq): the GROUP query heads of a kv head over the key tiles
    ``split, split + num_splits, ...`` (BLOCK_N positions each).

    Striding the tiles over a grid sized by host ints keeps every program busy whatever the
    context: a graph captured for ``max_model_len`` still spreads a short context over all splits.
    ``SPLIT_OUT``: the splits holding a tile (split 0 also when the context is empty) write their
    unnormalised partial (acc, max, sum) to scratch and count themselves in the (seq, kv head)'s
    arrival counter; the last to arrive combines the partials in split order, writes the output
    and resets the counter (see :mod:`vtcore.kernels.workspace`). Splits without a tile return at
    once. Otherwise (one split) the program writes the normalised output; an empty context gives zeros.
    Each tile's block-table entries are loaded a tile ahead (clamped to the row's ``max_blocks``, so
    the load needs no context length: the first one goes out beside the length's).
    ``EARLY`` (PDL): the block table, the lengths and the program's first K/V tile are read before
    waiting on the kernel before, which must write none of them but each sequence's last position
    (a decode step's qkv projection); the tile holding that position is read again after the wait.
    """
    if not EARLY:
        wait_prior(PDL)
    split = tl.program_id(0)
    kvh = tl.program_id(1)
    b = tl.program_id(2)
    offs_n = tl.arange(0, BLOCK_N)
    bt_row = bt_ptr + b.to(tl.int64) * stride_bt
    block = _table_blocks(bt_row, split * BLOCK_N + offs_n, max_blocks, BLOCK_SIZE)
    ctx = tl.load(lens_ptr + b)
    num_tiles = tl.cdiv(ctx, BLOCK_N)
    active = tl.maximum(tl.minimum(num_tiles, num_splits), 1)
    if SPLIT_OUT:
        if split >= active:
            return
    offs_g = tl.arange(0, BLOCK_G)
    offs_d = tl.arange(0, BLOCK_D)
    g_mask = offs_g < GROUP
    d_mask = offs_d < HEAD_DIM
    heads = kvh * GROUP + offs_g
    q_ptrs = q_ptr + b * stride_qs + heads[:, None] * stride_qh + offs_d[None, :] * stride_qd
    q_mask = g_mask[:, None] & d_mask[None, :]
    acc = tl.zeros((BLOCK_G, BLOCK_D), dtype=tl.float32)
    m_i = tl.full((BLOCK_G,), float("-inf"), dtype=tl.float32)
    l_i = tl.zeros((BLOCK_G,), dtype=tl.float32)
    first = split
    if EARLY:  # the first tile by hand: its K/V before the wait, the last position's again after it
        pos = split * BLOCK_N + offs_n
        kv_mask = (pos < ctx)[:, None] & d_mask[None, :]
        kv_off = _kv_offsets(kvh * stride_ch, block, pos, offs_d, stride_cs, stride_cd, BLOCK_SIZE)
        k0 = tl.load(k_ptr + kv_off, mask=kv_mask, other=0.0)
        v0 = tl.load(v_ptr + kv_off, mask=kv_mask, other=0.0)
        block = _table_blocks(bt_row, pos + num_splits * BLOCK_N, max_blocks, BLOCK_SIZE)
        wait_prior(PDL)
        if (split + 1) * BLOCK_N >= ctx:  # this tile holds position ctx - 1 (or none): this step wrote it
            k0 = tl.load(k_ptr + kv_off, mask=kv_mask, other=0.0)
            v0 = tl.load(v_ptr + kv_off, mask=kv_mask, other=0.0)
        q = tl.load(q_ptrs, mask=q_mask, other=0.0)
        if split < num_tiles:
            acc, m_i, l_i = _attend_tile(
                q, acc, m_i, l_i, k_ptr, v_ptr, bt_row, kvh * stride_ch, split * BLOCK_N, ctx, offs_g, scale_log2,
                stride_cs, stride_cd, offs_n, offs_d, d_mask,
                BLOCK_SIZE=BLOCK_SIZE, BOUNDED=True, CAUSAL=False, DOT_PRECISION=DOT_PRECISION, EARLY_V=True,
                k_tile=k0, v_tile=v0,
            )
        first = split + num_splits
    else:
        q = tl.load(q_ptrs, mask=q_mask, other=0.0)
    for t in range(first, num_tiles, num_splits):
        acc, m_i, l_i = _attend_tile(
            q, acc, m_i, l_i, k_ptr, v_ptr, bt_row, kvh * stride_ch, t * BLOCK_N, ctx, offs_g, scale_log2,
            stride_cs, stride_cd, offs_n, offs_d, d_mask,
            BLOCK_SIZE=BLOCK_SIZE, BOUNDED=True, CAUSAL=False, DOT_PRECISION=DOT_PRECISION, EARLY_V=True, block=block,
        )
        block = _table_blocks(bt_row, (t + num_splits) * BLOCK_N + offs_n, max_blocks, BLOCK_SIZE)
    if SPLIT_OUT:
        rows = b * stride_ps + heads * stride_ph + split * stride_pk
        tl.store(part_ptr + rows[:, None] + offs_d[None, :], acc, mask=g_mask[:, None] & d_mask[None, :])
        ml = b * stride_ms + heads * stride_mh + split * stride_mk
        tl.store(ml_ptr + ml, m_i, mask=g_mask)
        tl.store(ml_ptr + ml + 1, l_i, mask=g_mask)
        tl.debug_barrier()  # every thread's partial is issued before the (release) arrival
        counter = sem_ptr + b * tl.num_programs(1) + kvh
        if tl.atomic_add(counter, 1, sem="acq_rel", scope="gpu") != active - 1:
            return
        tl.atomic_xchg(counter, 0, sem="relaxed", scope="gpu")
        offs_gc = tl.arange(0, GROUP_P2)
        gc_mask = offs_gc < GROUP
        hc = kvh * GROUP + offs_gc
        o = _combine_splits(part_ptr + b * stride_ps, ml_ptr + b * stride_ms, active, stride_ph, stride_pk,
                            stride_mh, stride_mk, hc, gc_mask, offs_d, d_mask, CHUNK)
        tl.store(out_ptr + b * stride_os + hc[:, None] * stride_oh + offs_d[None, :] * stride_od,
                 o.to(out_ptr.dtype.element_ty), mask=gc_mask[:, None] & d_mask[None, :])
    else:
        o = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
        tl.store(out_ptr + b * stride_os + heads[:, None] * stride_oh + offs_d[None, :] * stride_od,
                 o.to(out_ptr.dtype.element_ty), mask=g_mask[:, None] & d_mask[None, :])


def decode_num_splits(num_seqs: int, num_kv_heads: int, max_context_len: int, block_n: int = _BLOCK_N) -> int:
    """Decode splits per (seq, kv head): enough for ``_TARGET_PROGRAMS`` programs, at most one per tile.

    At most ``_MAX_SPLITS``: in a graph sized for a long context, more splits would leave most of a
    kv head's programs with no tile at a short one, paying their start-up (docs/BENCHMARKS.md). Batch 1
    with 8 kv heads gets 32; batch 8 gets 16, batch 32 gets 4; batch 128 and up one, the
    single-kernel path.
    """
    per_seq = _TARGET_PROGRAMS // max(1, num_seqs * num_kv_heads)
    return max(1, min(triton.cdiv(max_context_len, block_n), per_seq, _MAX_SPLITS))


def _dot_precision(dtype: torch.dtype) -> str:
    return "ieee" if dtype == torch.float32 else "tf32"  # tf32 (the default) is moot for 16-bit inputs


def paged_decode_attention(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
    context_lens: torch.Tensor, scale: float, block_size: int, max_context_len: int,
    out: torch.Tensor | None = None, *, num_splits: int | None = None, block_n: int = _BLOCK_N, num_warps: int = 4,
    num_stages: int = 2, early_reads: bool = False,
) -> torch.Tensor:
    """One query per sequence over its first ``context_lens[b]`` cached positions (flash-decoding).

    ``q`` [seqs, heads, head_dim] (any strides); ``block_tables`` [seqs, max_blocks] int32/int64;
    ``context_lens`` [seqs] int32/int64, each <= ``max_context_len`` (a host int that sizes the
    grid: eager, the batch maximum; in a CUDA graph, ``max_model_len``). Returns ``out`` (allocated
    in q's dtype when None) [seqs, heads, head_dim]; a context of 0 gives zeros.

    Programs are (split, kv head, seq), each covering all heads of the GQA group, so K/V are read
    once per kv head; split ``i`` takes key tiles ``i, i + num_splits, ...`` of ``block_n``
    positions. With ``num_splits > 1`` partial results go to float32 scratch ``[seqs, heads,
    splits, head_dim]`` and ``[seqs, heads, splits, 2]`` (allocated per call, sized by host ints
    only) and the last split of a (seq, kv head) to finish combines them in split order, in the same
    launch; with one split each program writes ``out`` directly. ``num_splits`` defaults to :func:`decode_num_splits`.

    ``early_reads``: with programmatic dependent launch (:mod:`vtcore.kernels.pdl`) each program reads
    the block table, the context lengths and its first K/V tile before waiting on the kernel launched
    just before, overlapping that kernel's end; only correct when that kernel writes none of them
    except each sequence's last cached position (re-read after the wait), as a decode step's qkv
    projection with its cache write does (:meth:`vtcore.layers.attention.Attention.attend`). Used
    where the grid is at most ``_EARLY_PROGRAMS_PER_SM`` programs an SM (one wave).
    """
    seqs, heads, head_dim = q.shape
    kv_heads = k_cache.shape[1]
    if out is None:
        out = torch.empty((seqs, heads, head_dim), dtype=q.dtype, device=q.device)
    if seqs == 0:
        return out
    if block_n < 16 or block_n & (block_n - 1):
        raise ValueError(f"block_n={block_n} must be a power of two >= 16")
    if num_splits is not None and num_splits < 1:
        raise ValueError(f"num_splits={num_splits} must be >= 1")
    if not isinstance(early_reads, bool):
        raise TypeError(f"early_reads={early_reads!r}: expected True or False")
    num_splits = num_splits or decode_num_splits(seqs, kv_heads, max_context_len, block_n)
    if block_tables.shape[1] == 0:  # no context anywhere; the kernel reads a row's entry 0 unconditionally
        block_tables = torch.zeros((seqs, 1), dtype=block_tables.dtype, device=block_tables.device)
    group = heads // kv_heads
    group_p2 = triton.next_power_of_2(group)
    block_d = triton.next_power_of_2(head_dim)
    common = dict(GROUP=group, HEAD_DIM=head_dim, BLOCK_SIZE=block_size, BLOCK_G=max(16, triton.next_power_of_2(group)),
                  BLOCK_N=block_n, BLOCK_D=block_d, GROUP_P2=group_p2,
                  CHUNK=max(1, _COMBINE_VALUES // (group_p2 * block_d)), DOT_PRECISION=_dot_precision(q.dtype), num_warps=num_warps,
                  num_stages=num_stages, EARLY=early_reads and seqs * kv_heads * num_splits <= _EARLY_PROGRAMS_PER_SM * num_sms(q.device),
                  **pdl_launch(q.device))
    strides = (q.stride(0), q.stride(1), q.stride(2), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
               block_tables.stride(0), out.stride(0), out.stride(1), out.stride(2))
    grid = (num_splits, kv_heads, seqs)
    if num_splits == 1:
        _decode_kernel[grid](q, k_cache, v_cache, block_tables, context_lens, out, out, out, out,
                             scale * _LOG2E, 1, block_tables.shape[1], *strides, 0, 0, 0, 0, 0, 0, SPLIT_OUT=False, **common)
        return out
    part = torch.empty((seqs, heads, num_splits, head_dim), dtype=torch.float32, device=q.device)
    ml = torch.empty((seqs, heads, num_splits, 2), dtype=torch.float32, device=q.device)
    pml_strides = (part.stride(0), part.stride(1), part.stride(2), ml.stride(0), ml.stride(1), ml.stride(2))
    _decode_kernel[grid](q, k_cache, v_cache, block_tables, context_lens, out, part, ml,
                         arrival_counters(q.device, seqs * kv_heads), scale * _LOG2E, num_splits, block_tables.shape[1],
                         *strides,
                         *pml_strides, SPLIT_OUT=True, **common)
    return out


# ----------------------------------------------------------------------------- prefill


@triton.jit(do_not_specialize=["stride_bt", "stride_mt", "stride_mh"])
def _prefill_kernel(
    q_ptr, k_ptr, v_ptr, bt_ptr, qsl_ptr, lens_ptr, out_ptr, part_ptr, ml_ptr, scale_log2, num_splits,
    stride_qt, stride_qh, stride_qd,
    stride_cs, stride_ch, stride_cd,
    stride_bt,
    stride_ot, stride_oh, stride_od,
    stride_pt, stride_ph, stride_pk,
    stride_mt, stride_mh, stride_mk,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, DOT_PRECISION: tl.constexpr,
    SPLIT_OUT: tl.constexpr,
):
    """Program (query block x split, head, seq): BLOCK_M queries of one head, causal over the paged
    context, over every ``num_splits``-th key tile from the ``split``-th of each of the two ranges below.

    Keys below the block's first query position (rounded down to BLOCK_N) are visible to every row
    and run unmasked; the tiles up to the last row's position run with the causal mask. ``SPLIT_OUT``:
    the unnormalised partial (acc, max, sum) goes to scratch for ``_prefill_combine_kernel``; a split
    may hold no tile, or only tiles some of its rows see nothing of, so the running max starts at a
    finite floor (a row that saw nothing keeps it, with sum 0, and weighs 0 in the combine).
    Otherwise (one split) the program writes the normalised output.
    """
    pid_m = tl.program_id(0) // num_splits
    split = tl.program_id(0) % num_splits
    h = tl.program_id(1)
    b = tl.program_id(2)
    q_start = tl.load(qsl_ptr + b)
    qlen = tl.load(qsl_ptr + b + 1) - q_start
    m0 = pid_m * BLOCK_M
    if m0 >= qlen:
        return
    ctx = tl.load(lens_ptr + b)
    offs_m = m0 + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    d_mask = offs_d < HEAD_DIM
    row_mask = (offs_m < qlen)[:, None] & d_mask[None, :]
    rows = (q_start + offs_m).to(tl.int64)
    q = tl.load(q_ptr + rows[:, None] * stride_qt + h * stride_qh + offs_d[None, :] * stride_qd,
                mask=row_mask, other=0.0)
    q_pos = ctx - qlen + offs_m
    first_pos = ctx - qlen + m0
    full_tiles = (first_pos + 1) // BLOCK_N
    causal_tiles = tl.cdiv(tl.minimum(ctx, first_pos + BLOCK_M), BLOCK_N)
    acc = tl.zeros((BLOCK_M, BLOCK_D), dtype=tl.float32)
    m_i = tl.full((BLOCK_M,), _M_FLOOR, dtype=tl.float32)
    l_i = tl.zeros((BLOCK_M,), dtype=tl.float32)
    bt_row = bt_ptr + b.to(tl.int64) * stride_bt
    kv_head_off = (h // GROUP) * stride_ch
    for t in range(split, full_tiles, num_splits):
        acc, m_i, l_i = _attend_tile(
            q, acc, m_i, l_i, k_ptr, v_ptr, bt_row, kv_head_off, t * BLOCK_N, ctx, q_pos, scale_log2,
            stride_cs, stride_cd, offs_n, offs_d, d_mask,
            BLOCK_SIZE=BLOCK_SIZE, BOUNDED=False, CAUSAL=False, DOT_PRECISION=DOT_PRECISION,
        )
    for t in range(full_tiles + split, causal_tiles, num_splits):
        acc, m_i, l_i = _attend_tile(
            q, acc, m_i, l_i, k_ptr, v_ptr, bt_row, kv_head_off, t * BLOCK_N, ctx, q_pos, scale_log2,
            stride_cs, stride_cd, offs_n, offs_d, d_mask,
            BLOCK_SIZE=BLOCK_SIZE, BOUNDED=True, CAUSAL=True, DOT_PRECISION=DOT_PRECISION,
        )
    if SPLIT_OUT:
        part = rows[:, None] * stride_pt + h * stride_ph + split * stride_pk + offs_d[None, :]
        tl.store(part_ptr + part, acc, mask=row_mask)
        ml = rows * stride_mt + h * stride_mh + split * stride_mk
        tl.store(ml_ptr + ml, m_i, mask=offs_m < qlen)
        tl.store(ml_ptr + ml + 1, l_i, mask=offs_m < qlen)
    else:
        o = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
        tl.store(out_ptr + rows[:, None] * stride_ot + h * stride_oh + offs_d[None, :] * stride_od,
                 o.to(out_ptr.dtype.element_ty), mask=row_mask)


@triton.jit(do_not_specialize=["num_seqs", "stride_mt", "stride_mh"])
def _prefill_combine_kernel(
    part_ptr, ml_ptr, qsl_ptr, out_ptr, num_splits, num_seqs, num_heads,
    stride_pt, stride_ph, stride_pk, stride_mt, stride_mh, stride_mk, stride_ot, stride_oh, stride_od,
    HEAD_DIM: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, CHUNK: tl.constexpr,
):
    """Program (query row, head block): the row's split partials combined in split order; rows past
    the last sequence's end (padding) are left unwritten."""
    t = tl.program_id(0)
    if t >= tl.load(qsl_ptr + num_seqs):
        return
    offs_h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    h_mask = offs_h < num_heads
    d_mask = offs_d < HEAD_DIM
    row = t.to(tl.int64)
    o = _combine_splits(part_ptr + row * stride_pt, ml_ptr + row * stride_mt, num_splits, stride_ph, stride_pk,
                        stride_mh, stride_mk, offs_h, h_mask, offs_d, d_mask, CHUNK)
    tl.store(out_ptr + row * stride_ot + offs_h[:, None] * stride_oh + offs_d[None, :] * stride_od,
             o.to(out_ptr.dtype.element_ty), mask=h_mask[:, None] & d_mask[None, :])


def prefill_num_splits(max_query_len: int, heads: int, seqs: int, max_context_len: int, device: torch.device,
                       block_m: int = _PREFILL_BLOCK_M, block_n: int = _PREFILL_BLOCK_N) -> int:
    """Key splits per (query block, head, seq): with few query blocks over a long context (a chunk
    after a cached prefix, a short prompt's tail), enough for ``_PREFILL_PROGRAMS_PER_SM`` programs an
    SM, each split keeping at least ``_PREFILL_MIN_TILES`` key tiles; at most ``_PREFILL_MAX_SPLITS``."""
    programs = triton.cdiv(max_query_len, block_m) * heads * seqs
    wanted = _PREFILL_PROGRAMS_PER_SM * num_sms(device) // max(1, programs)
    return max(1, min(wanted, triton.cdiv(max_context_len, block_n) // _PREFILL_MIN_TILES, _PREFILL_MAX_SPLITS))


def paged_prefill_attention(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
    query_start_loc: torch.Tensor, context_lens: torch.Tensor, scale: float, block_size: int,
    max_query_len: int, max_context_len: int, out: torch.Tensor | None = None, *,
    block_m: int | None = None, block_n: int = _PREFILL_BLOCK_N, num_splits: int | None = None, num_warps: int = 4,
    num_stages: int = 2,
) -> torch.Tensor:
    """Causal varlen attention of new query rows over the paged cache (chunked prefill included).

    ``q`` [tokens, heads, head_dim] (any strides): sequence ``b`` owns rows
    ``query_start_loc[b]:query_start_loc[b + 1]`` ([seqs + 1], int32/int64), the last ``qlen`` of
    its ``context_lens[b]`` positions, all already in the cache; query ``i`` sees positions
    ``<= context_lens[b] - qlen + i``. ``max_query_len`` and ``max_context_len`` (host ints, each at
    least the batch's) size the grid. Returns ``out`` [tokens, heads, head_dim] in q's dtype; rows
    past ``query_start_loc[-1]`` are left unwritten. ``block_m`` defaults to 64 whatever the batch,
    so that no batch shape makes Triton compile another variant mid-run (docs/BENCHMARKS.md);
    ``block_m``/``block_n`` must be powers of two >= 16. ``num_splits`` (default
    :func:`prefill_num_splits`) > 1 splits each block's key tiles over that many programs, whose
    float32 partials ``[tokens, heads, splits, head_dim]`` and ``[tokens, heads, splits, 2]``
    (allocated per call, sized by host ints) a second launch combines in split order.
    """
    tokens, heads, head_dim = q.shape
    seqs = query_start_loc.shape[0] - 1
    if out is None:
        out = torch.empty((tokens, heads, head_dim), dtype=q.dtype, device=q.device)
    if tokens == 0 or seqs == 0 or max_query_len == 0:
        return out
    if num_splits is not None and num_splits < 1:
        raise ValueError(f"num_splits={num_splits} must be >= 1")
    bm = block_m or _PREFILL_BLOCK_M
    splits = num_splits or prefill_num_splits(max_query_len, heads, seqs, max_context_len, q.device, bm, block_n)
    block_d = triton.next_power_of_2(head_dim)
    part = ml = out
    pml_strides = (0,) * 6
    if splits > 1:
        part = torch.empty((tokens, heads, splits, head_dim), dtype=torch.float32, device=q.device)
        ml = torch.empty((tokens, heads, splits, 2), dtype=torch.float32, device=q.device)
        pml_strides = (part.stride(0), part.stride(1), part.stride(2), ml.stride(0), ml.stride(1), ml.stride(2))
    _prefill_kernel[(triton.cdiv(max_query_len, bm) * splits, heads, seqs)](
        q, k_cache, v_cache, block_tables, query_start_loc, context_lens, out, part, ml, scale * _LOG2E, splits,
        q.stride(0), q.stride(1), q.stride(2),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        block_tables.stride(0),
        out.stride(0), out.stride(1), out.stride(2),
        *pml_strides,
        GROUP=heads // k_cache.shape[1], HEAD_DIM=head_dim, BLOCK_SIZE=block_size,
        BLOCK_M=bm, BLOCK_N=block_n, BLOCK_D=block_d,
        DOT_PRECISION=_dot_precision(q.dtype), SPLIT_OUT=splits > 1, num_warps=num_warps, num_stages=num_stages,
    )
    if splits > 1:
        block_h = min(triton.next_power_of_2(heads), 32)
        _prefill_combine_kernel[(tokens, triton.cdiv(heads, block_h))](
            part, ml, query_start_loc, out, splits, seqs, heads, *pml_strides,
            out.stride(0), out.stride(1), out.stride(2),
            HEAD_DIM=head_dim, BLOCK_H=block_h, BLOCK_D=block_d,
            CHUNK=max(1, _COMBINE_VALUES // (block_h * block_d)), num_warps=4,
        )
    return out


# ----------------------------------------------------------------------------- torch references


def write_kv_cache_ref(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                       slot_mapping: torch.Tensor) -> None:
    """:func:`write_kv_cache` in torch, padded rows' ``k`` and ``v`` zeroed in place too. Negative slots
    are dropped explicitly: indexing with -1 would write the last slot."""
    keep = slot_mapping >= 0
    k.masked_fill_(~keep[:, None, None], 0)
    v.masked_fill_(~keep[:, None, None], 0)
    slots = slot_mapping[keep]
    k_cache[slots] = k[keep].to(k_cache.dtype)
    v_cache[slots] = v[keep].to(v_cache.dtype)


def _gather_context(cache: torch.Tensor, block_tables: torch.Tensor, block_size: int, n: int) -> torch.Tensor:
    """The first ``n`` positions of every sequence, float32 [seqs, kv_heads, n, head_dim] (past a
    sequence's table, the last block's slots stand in: callers mask them)."""
    pos = torch.arange(n, device=cache.device)
    cols = (pos // block_size).clamp_max(block_tables.shape[1] - 1)
    slots = block_tables[:, cols].long() * block_size + pos % block_size
    return cache[slots].float().transpose(1, 2)


def _sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, allowed: torch.Tensor, scale: float) -> torch.Tensor:
    """float32 SDPA; rows that see nothing attend to key 0 instead of turning NaN (callers zero
    them)."""
    allowed = allowed | (torch.arange(k.shape[2], device=k.device) == 0)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=allowed, scale=scale,
                                          enable_gqa=q.shape[1] != k.shape[1])


def paged_decode_attention_ref(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
    context_lens: torch.Tensor, scale: float, block_size: int, max_context_len: int,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """:func:`paged_decode_attention` in torch: gather every sequence's first ``max_context_len``
    positions, mask those at or past its context length."""
    n = max(1, max_context_len)
    k = _gather_context(k_cache, block_tables, block_size, n)
    v = _gather_context(v_cache, block_tables, block_size, n)
    lens = context_lens.long()
    allowed = torch.arange(n, device=q.device) < lens[:, None]  # [seqs, n]
    o = _sdpa(q.float().unsqueeze(2), k, v, allowed[:, None, None, :], scale).squeeze(2)
    o = torch.where((lens > 0)[:, None, None], o, 0.0).to(q.dtype)
    if out is None:
        return o
    out.copy_(o)
    return out


def paged_prefill_attention_ref(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
    query_start_loc: torch.Tensor, context_lens: torch.Tensor, scale: float, block_size: int,
    max_query_len: int, max_context_len: int, out: torch.Tensor | None = None,
) -> torch.Tensor:
    """:func:`paged_prefill_attention` in torch, over a padded [seqs, max_query_len] query layout;
    each token is then gathered back by index (no boolean masking: no sync). Rows past
    ``query_start_loc[-1]`` come out zero."""
    tokens = q.shape[0]
    if tokens == 0:
        return out if out is not None else torch.empty_like(q)
    qsl, lens = query_start_loc.long(), context_lens.long()
    qlens = qsl[1:] - qsl[:-1]
    i = torch.arange(max(1, max_query_len), device=q.device)
    rows = (qsl[:-1, None] + i).clamp(0, max(0, tokens - 1))  # [seqs, max_q]
    q_pos = lens[:, None] - qlens[:, None] + i
    n = max(1, max_context_len)
    key_pos = torch.arange(n, device=q.device)
    allowed = (key_pos <= q_pos[:, :, None]) & (key_pos < lens[:, None, None])  # [seqs, max_q, n]
    k = _gather_context(k_cache, block_tables, block_size, n)
    v = _gather_context(v_cache, block_tables, block_size, n)
    o = _sdpa(q[rows].float().transpose(1, 2), k, v, allowed[:, None], scale).transpose(1, 2)  # [seqs, max_q, heads, d]
    t = torch.arange(tokens, device=q.device)
    seq = (torch.searchsorted(qsl, t, right=True) - 1).clamp(0, qlens.shape[0] - 1)
    idx = (t - qsl[seq]).clamp(0, i.shape[0] - 1)
    o = torch.where((t < qsl[-1])[:, None, None], o[seq, idx], 0.0).to(q.dtype)
    if out is None:
        return o
    out.copy_(o)
    return out
