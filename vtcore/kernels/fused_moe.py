"""Fused MoE: softmax top-k routing and the routed experts' SwiGLU MLPs, without a host sync.

Semantics (``fused_experts``; ``fused_experts_ref`` states them as plain loops)::

    out[t] = sum_{j = 0 .. k-1} weight[t, j] * down_e(silu(gate_e(x[t])) * up_e(x[t])),  e = topk_ids[t, j]

Rounding points, for an activation dtype ``dt`` (bf16 / fp16; float32 rounds nowhere):

1. ``gate`` and ``up``: float32 accumulation of ``x . w`` (16-bit products are exact in float32),
   each rounded once to ``dt``, as the ``[T, 2I]`` output of ``F.linear`` in ``dt`` is.
2. ``act = silu(gate) * up`` as ``silu_and_mul`` on ``dt`` tensors: ``gate / (1 + exp(-gate))``
   in float32 (IEEE division) rounded to ``dt``, its product with ``up`` in float32 rounded to ``dt``.
3. ``down``: float32 accumulation of ``act . w``, *not* rounded; the slots are combined in float32 in
   slot order, ``acc = 0; acc += weight[t, j] * y_j`` for j = 0, 1, ..., and ``acc`` is rounded to
   ``dt`` once. (The model's ``Experts.forward`` rounds ``y_j``, the product and every ``index_add``
   to ``dt`` and visits experts in id order; this is its float32 accumulation, more accurate, and
   independent of which other tokens picked an expert.) Each product ``weight * y_j`` is a float32
   value of its own (the decode path stores it; no FMA).

``topk_weights`` may be float32 (``moe_route``'s) or ``dt`` (the model's ``.to(x.dtype)``); they
are read as float32. Expert ids outside ``[0, E)`` (e.g. -1 for "not on this rank") contribute
nothing: a host check would need a sync, so the kernels mask such slots instead. Atomics only count
arrivals (the decode down launch) and the summation order is fixed: a call gives the same bits every
time (the decode and prefill paths differ from each other in the float32 summation order only).

FP4 (W4A16, ``fp4=FP4Experts(...)``): packed E2M1 codes and raw scale bytes are decoded in
registers with :mod:`vtcore.kernels.helpers`' FP4 decode (NVFP4 global scales: the gate's for gate
rows, the up's for up rows; MXFP4: ``2^(b-127)``). No dense weight is ever materialised. The
prefill path forms ``w = code * (e4m3 / global)`` in float32 rounded to ``dt`` for a 16-bit ``x``
(compressed-tensors' bf16 decompressed weight), as ``fp4_gemm`` does; the decode path sums
group-factored, ``(sum_g s_g sum_{i in g} c_i x_i) / global`` in float32, no weight rounded (the
float32 decoded weight of :func:`vtcore.kernels.fp4.fp4_linear_reference`, the model's CPU path,
up to float32 rounding).

Decode path (T <= 16 by default), two launches, each one grouped launch over the token's k experts:

* ``_decode_gate_up_kernel``, grid ``(T * k, cdiv(I, BLOCK_N))``: a program reads its expert id
  from ``topk_ids`` on the device and streams ``BLOCK_N`` gate rows and the matching up rows of
  that expert (tiles contiguous along K, elementwise float32 accumulators summed once at the end,
  as ``gemv``'s M == 1 path), applies ``silu(gate) * up`` and writes ``act [T * k, I]``. Tokens
  sharing an expert each stream its rows (L2 absorbs the repeats at decode sizes).
* ``_decode_down_kernel``, grid ``(T, cdiv(H, BLOCK_N), k)``: a program per slot, GEMV of
  ``act[t * k + j]`` with ``down_e`` times ``weight``, stored float32; the last of a tile's k
  programs to arrive (:mod:`vtcore.kernels.workspace`'s counters) sums them in slot order and
  rounds once (``4 * T * k * H`` bytes of workspace).

Prefill path (T > 16), grouped GEMMs (``tl.dot``) over rows sorted by expert, as vLLM's
``moe_align_block_size``: the flattened ``(token, slot)`` rows are grouped by expert id on the
device, in (token, slot) order within an expert (``_align``), each expert's rows padded to a multiple of ``BLOCK_M``; block ``b`` holds
rows of one expert (``block_expert[b]``, or E past the end: the program returns). The grid is sized
by the host-int bound ``(T * k + min(E, T * k) * (BLOCK_M - 1)) // BLOCK_M`` (at most
``T * k / BLOCK_M + E``) blocks, so no count is read back. Three launches after the two of the
grouping (``_align``): gate_up (+ silu * up epilogue) writes ``act [T * k, I]``, down writes float32
``y [T * k, H]`` (4 * T * k * H bytes of workspace: the price of the single rounding), and
``_slot_sum_kernel`` forms ``out[t]`` from ``y`` in slot order as the decode path does.

Launch configs come from host ints only (shapes, dtypes, forced blocks): the decode path can be
captured in a CUDA graph. Block sizes: ``_decode_blocks`` (from a sweep) and ``_prefill_blocks``
(untuned defaults).
"""
from __future__ import annotations

import functools
from typing import Literal

import attrs
import torch
import triton
import triton.language as tl
from torch.nn import functional as F

from vtcore.kernels.device import num_sms
from vtcore.kernels.fp4 import dequantize_fp4, group_scales
from vtcore.kernels.helpers import (INTERPRET, cast, e2m1_to_f32, e4m3_to_f32, e8m0_to_f32, exp, fp4_step, load,
                                    silu_mul)
from vtcore.kernels.workspace import arrival_counters

__all__ = ["FP4Experts", "moe_route", "moe_route_ref", "fused_experts", "fused_experts_ref"]

_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
_DECODE_MAX_T = 16
_GEMV_TILE_BYTES = 8192  # dense weight bytes per decode program per K step


@attrs.frozen
class FP4Experts:
    """Packed FP4 expert weights, as ``Experts`` holds them under an FP4 quant method.

    ``gate_up_packed`` uint8 ``[E, 2I, H/2]`` (gate rows, then up rows), ``gate_up_scale``
    ``[E, 2I, H/g]``, ``down_packed`` uint8 ``[E, H, I/2]``, ``down_scale`` ``[E, H, I/g]``; scales
    are float8_e4m3fn (or its uint8 bytes) for ``scale_kind="e4m3"`` (NVFP4) and uint8 E8M0 bytes for
    ``"e8m0"`` (MXFP4). NVFP4 global scales: float32 ``gate_up_global_scale [E, 2]`` (gate, up) and
    ``down_global_scale [E, 1]``, or None (MXFP4 has none).
    """

    gate_up_packed: torch.Tensor
    gate_up_scale: torch.Tensor
    down_packed: torch.Tensor
    down_scale: torch.Tensor
    scale_kind: str
    group_size: int
    gate_up_global_scale: torch.Tensor | None = None
    down_global_scale: torch.Tensor | None = None


# ----------------------------------------------------------------------------------------- routing

@triton.jit
def _route_kernel(logits_ptr, ids_ptr, weights_ptr, stride_t,
                  E: tl.constexpr, TOP_K: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr,
                  INTERPRET: tl.constexpr):
    """One token: float32 softmax over E, k rounds of (max, lowest index holding it), renormalised."""
    t = tl.program_id(0)
    offs = tl.arange(0, BLOCK_E)
    mask = offs < E
    z = tl.load(logits_ptr + t.to(tl.int64) * stride_t + offs, mask=mask, other=float("-inf")).to(tl.float32)
    p = tl.where(mask, exp(z - tl.max(z, axis=0), INTERPRET), 0.0)
    p = tl.div_rn(p, tl.broadcast_to(tl.sum(p, axis=0), (BLOCK_E,)))
    p = tl.where(mask, p, -1.0)  # below every probability: padding lanes are never picked
    offs_k = tl.arange(0, BLOCK_K)
    top = tl.zeros((BLOCK_K,), dtype=tl.float32)
    ids = tl.zeros((BLOCK_K,), dtype=tl.int32)
    total = tl.zeros((), dtype=tl.float32)
    for j in tl.static_range(TOP_K):
        v = tl.max(p, axis=0)
        i = tl.min(tl.where(p == v, offs, BLOCK_E), axis=0)
        top = tl.where(offs_k == j, v, top)
        ids = tl.where(offs_k == j, i, ids)
        total += v
        p = tl.where(offs == i, -1.0, p)
    out = t * TOP_K + offs_k
    tl.store(ids_ptr + out, ids, mask=offs_k < TOP_K)
    tl.store(weights_ptr + out, tl.div_rn(top, tl.broadcast_to(total, (BLOCK_K,))), mask=offs_k < TOP_K)


def moe_route_ref(router_logits: torch.Tensor, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Torch reference of :func:`moe_route` (``SparseMoE.forward``'s routing, before its cast to
    ``x.dtype``); ties go the way ``torch.topk`` breaks them on the device at hand."""
    probs = torch.softmax(router_logits, dim=-1, dtype=torch.float32)
    top, ids = probs.topk(top_k, dim=-1)
    return ids.to(torch.int32), top / top.sum(dim=-1, keepdim=True)


def moe_route(router_logits: torch.Tensor, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(topk_ids int32 [T, k], topk_weights float32 [T, k])`` from ``router_logits`` [T, E]
    (any float dtype; rows may be strided, the last dim contiguous): softmax in float32, the k
    largest probabilities in descending order, divided by their sum (added in slot order).

    One program per token, one launch. Equal probabilities go to the lowest expert index first
    (what ``torch.topk`` typically does on CUDA; it promises no order).
    """
    if router_logits.dim() != 2 or not router_logits.is_floating_point():
        raise ValueError(f"router_logits: shape {tuple(router_logits.shape)} dtype {router_logits.dtype}, "
                         "expected a floating [T, E] tensor")
    t, e = router_logits.shape
    if not 1 <= top_k <= e:
        raise ValueError(f"top_k={top_k}: expected 1 <= top_k <= E={e} (router_logits {tuple(router_logits.shape)})")
    if e > 1 and router_logits.stride(1) != 1:
        raise ValueError(f"router_logits: last-dim stride {router_logits.stride(1)}, expected 1")
    ids = torch.empty((t, top_k), dtype=torch.int32, device=router_logits.device)
    weights = torch.empty((t, top_k), dtype=torch.float32, device=router_logits.device)
    if t:
        block_e = triton.next_power_of_2(e)
        _route_kernel[(t,)](router_logits, ids, weights, router_logits.stride(0), E=e, TOP_K=top_k, BLOCK_E=block_e,
                            BLOCK_K=triton.next_power_of_2(top_k), INTERPRET=INTERPRET,
                            num_warps=max(1, min(8, block_e // 128)))
    return ids, weights


# ----------------------------------------------------------------------------------- shared pieces
@triton.jit
def _group_scale(sb, gs_ptr, SCALE_E8M0: tl.constexpr, HAS_GLOBAL: tl.constexpr):
    """Raw int32 scale bytes -> float32 group scales (NVFP4: divided by the global at ``gs_ptr``)."""
    if SCALE_E8M0:
        scale = e8m0_to_f32(sb)
    else:
        scale = e4m3_to_f32(sb)
        if HAS_GLOBAL:
            scale = tl.div_rn(scale, tl.load(gs_ptr))
    return scale


@triton.jit
def _silu_mul(gate, up, DT: tl.constexpr, INTERPRET: tl.constexpr):
    """float32 ``gate``, ``up`` -> ``silu(gate) * up`` in ``DT``, rounded as ``silu_and_mul`` on
    ``DT`` tensors (rounding points 1 and 2 of the module docstring)."""
    return silu_mul(cast(gate, DT, INTERPRET).to(tl.float32), cast(up, DT, INTERPRET).to(tl.float32), DT, INTERPRET)


@triton.jit
def _gemv(x_ptr, stride_xk, valid, w_ptr, rows, stride_wn, stride_wk, s_ptr, stride_sn, stride_sg, gs_ptr,
          K: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, FP4: tl.constexpr, GROUP: tl.constexpr,
          SCALE_E8M0: tl.constexpr, HAS_GLOBAL: tl.constexpr, DT: tl.constexpr, INTERPRET: tl.constexpr):
    """float32 ``[BLOCK_N]``: one x row (``x_ptr``) times weight ``rows`` (in bounds) of one expert.

    Elementwise products into a float32 tile summed over K once, at the end. ``valid`` (a scalar)
    false makes the result 0: dense, every load is masked off (no byte read); FP4 with K a multiple
    of BLOCK_K loads unmasked (so that the packed loads stay 16-byte vectors), the caller's clamped
    expert 0, and discards it.
    """
    k_end = tl.where(valid, K, 0)  # (a scalar & vector mask trips the interpreter)
    if FP4:  # group-factored, ``w_ptr`` at int32 words of 8 codes (gemv's FP4 path); the global divides once
        EVEN: tl.constexpr = K % BLOCK_K == 0
        offs_w = tl.arange(0, BLOCK_K // 8)
        offs_g = tl.arange(0, BLOCK_K // GROUP)
        acc = tl.zeros((BLOCK_N, BLOCK_K // 8), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            w = load(w_ptr + rows[:, None] * stride_wn + (k0 // 8 + offs_w)[None, :] * stride_wk,
                     (offs_w + k0 // 8 < K // 8)[None, :], EVEN)
            g = k0 // GROUP + offs_g
            sb = load(s_ptr + rows[:, None] * stride_sn + g[None, :] * stride_sg, (g < K // GROUP)[None, :],
                      EVEN).to(tl.int32)
            acc += fp4_step(w, sb, x_ptr, k0, K, stride_xk, BLOCK_N, BLOCK_K, GROUP, SCALE_E8M0, EVEN)
        y = tl.where(valid, tl.sum(acc, axis=1), 0.0)
        if HAS_GLOBAL:
            y = tl.div_rn(y, tl.load(gs_ptr))
    else:
        offs_k = tl.arange(0, BLOCK_K)
        acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            kk = k0 + offs_k
            k_mask = kk < k_end
            w = tl.load(w_ptr + rows[:, None] * stride_wn + kk[None, :] * stride_wk, mask=k_mask[None, :], other=0.0)
            xv = tl.load(x_ptr + kk * stride_xk, mask=k_mask, other=0.0)
            acc += w.to(tl.float32) * xv.to(tl.float32)[None, :]
        y = tl.sum(acc, axis=1)
    return y


@triton.jit
def _gemm(x_ptr, x_off, m_mask, stride_xk, w_ptr, rows, stride_wn, stride_wk, s_ptr, stride_sn, stride_sg, gs_ptr,
          K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, FP4: tl.constexpr,
          GROUP: tl.constexpr, SCALE_E8M0: tl.constexpr, HAS_GLOBAL: tl.constexpr, DT: tl.constexpr,
          DOT_PRECISION: tl.constexpr, INTERPRET: tl.constexpr):
    """float32 ``[BLOCK_M, BLOCK_N]``: x rows at offsets ``x_off`` (``m_mask``) times weight ``rows``
    (in bounds) of one expert, by ``tl.dot``. FP4 as ``fp4_gemm``: the low nibbles of a
    ``[BLOCK_K/2, BLOCK_N]`` byte tile multiply x's even columns, the high nibbles the odd ones."""
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    if FP4:
        HALF_K: tl.constexpr = BLOCK_K // 2
        GROUPS: tl.constexpr = BLOCK_K // GROUP
        offs_p = tl.arange(0, HALF_K)
        offs_g = tl.arange(0, GROUPS)
        for k0 in range(0, K, BLOCK_K):
            p = k0 // 2 + offs_p
            p_mask = p < K // 2
            wb = tl.load(w_ptr + rows[None, :] * stride_wn + p[:, None] * stride_wk, mask=p_mask[:, None],
                         other=0).to(tl.int32)
            g = k0 // GROUP + offs_g
            sb = tl.load(s_ptr + rows[None, :] * stride_sn + g[:, None] * stride_sg, mask=(g < K // GROUP)[:, None],
                         other=0).to(tl.int32)
            scale = _group_scale(sb, gs_ptr, SCALE_E8M0, HAS_GLOBAL)[:, None, :]
            w_lo = tl.reshape(tl.reshape(e2m1_to_f32(wb & 0xF), (GROUPS, GROUP // 2, BLOCK_N)) * scale,
                              (HALF_K, BLOCK_N))
            w_hi = tl.reshape(tl.reshape(e2m1_to_f32((wb >> 4) & 0xF), (GROUPS, GROUP // 2, BLOCK_N)) * scale,
                              (HALF_K, BLOCK_N))
            x_at = x_ptr + x_off[:, None] + (2 * p)[None, :] * stride_xk
            x_mask = m_mask[:, None] & p_mask[None, :]
            x_even = tl.load(x_at, mask=x_mask, other=0.0)
            x_odd = tl.load(x_at + stride_xk, mask=x_mask, other=0.0)
            acc = tl.dot(x_even, cast(w_lo, DT, INTERPRET), acc, input_precision=DOT_PRECISION)
            acc = tl.dot(x_odd, cast(w_hi, DT, INTERPRET), acc, input_precision=DOT_PRECISION)
    else:
        offs_k = tl.arange(0, BLOCK_K)
        for k0 in range(0, K, BLOCK_K):
            kk = k0 + offs_k
            k_mask = kk < K
            w = tl.load(w_ptr + rows[None, :] * stride_wn + kk[:, None] * stride_wk, mask=k_mask[:, None], other=0.0)
            xt = tl.load(x_ptr + x_off[:, None] + kk[None, :] * stride_xk, mask=m_mask[:, None] & k_mask[None, :],
                         other=0.0)
            acc = tl.dot(xt, w, acc, input_precision=DOT_PRECISION)
    return acc


@triton.jit
def _expert(ids_ptr, row, E: tl.constexpr):
    """(expert id as int64, clamped to 0 when out of range; whether it was in range) of one slot."""
    e = tl.load(ids_ptr + row)
    valid = (e >= 0) & (e < E)
    return tl.where(valid, e, 0).to(tl.int64), valid


# ------------------------------------------------------------------------------------- decode path
@triton.jit
def _decode_gate_up_kernel(
    x_ptr, ids_ptr, act_ptr, stride_xt, stride_xk,
    w_ptr, s_ptr, gs_ptr, stride_we, stride_wn, stride_wk, stride_se, stride_sn, stride_sg,
    E: tl.constexpr, H: tl.constexpr, I: tl.constexpr, TOP_K: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, FP4: tl.constexpr, GROUP: tl.constexpr,
    SCALE_E8M0: tl.constexpr, HAS_GLOBAL: tl.constexpr, INTERPRET: tl.constexpr,
):
    """Program (row = t * TOP_K + j, n tile): ``act[row, n tile]`` for expert ``topk_ids[t, j]``."""
    DT: tl.constexpr = x_ptr.dtype.element_ty
    row = tl.program_id(0)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    e, valid = _expert(ids_ptr, row, E)
    rows = tl.minimum(offs_n, I - 1)  # rows past I are computed from row I - 1 and not stored
    x_row = x_ptr + (row // TOP_K).to(tl.int64) * stride_xt
    w_e = w_ptr + e * stride_we
    s_e = s_ptr + e * stride_se
    gate = _gemv(x_row, stride_xk, valid, w_e, rows, stride_wn, stride_wk, s_e, stride_sn, stride_sg, gs_ptr + 2 * e,
                 H, BLOCK_N, BLOCK_K, FP4, GROUP, SCALE_E8M0, HAS_GLOBAL, DT, INTERPRET)
    up = _gemv(x_row, stride_xk, valid, w_e + I * stride_wn, rows, stride_wn, stride_wk, s_e + I * stride_sn,
               stride_sn, stride_sg, gs_ptr + 2 * e + 1, H, BLOCK_N, BLOCK_K, FP4, GROUP, SCALE_E8M0, HAS_GLOBAL,
               DT, INTERPRET)
    tl.store(act_ptr + row.to(tl.int64) * I + offs_n, _silu_mul(gate, up, DT, INTERPRET), mask=offs_n < I)


@triton.jit
def _decode_down_kernel(
    act_ptr, ids_ptr, weights_ptr, out_ptr, ws_ptr, sem_ptr,
    w_ptr, s_ptr, gs_ptr, stride_we, stride_wn, stride_wk, stride_se, stride_sn, stride_sg,
    E: tl.constexpr, H: tl.constexpr, I: tl.constexpr, TOP_K: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, FP4: tl.constexpr, GROUP: tl.constexpr,
    SCALE_E8M0: tl.constexpr, HAS_GLOBAL: tl.constexpr, INTERPRET: tl.constexpr,
):
    """Program (token t, n tile, slot j): ``weight[t, j] * down_e(act[t * TOP_K + j])`` for the n tile
    into the float32 workspace ``ws [T, TOP_K, H]``; then it counts itself in the (t, n tile)
    arrival counter, and the last of the TOP_K to arrive sums the slots in order 0, 1, ... (the
    order the module docstring fixes), rounds once, writes ``out`` and resets the counter. A slot a
    program: TOP_K times the programs of one loop over the slots (the launch was latency-bound)."""
    DT: tl.constexpr = act_ptr.dtype.element_ty
    t = tl.program_id(0)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    j = tl.program_id(2)
    rows = tl.minimum(offs_n, H - 1)
    row = t * TOP_K + j
    e, valid = _expert(ids_ptr, row, E)
    weight = tl.where(valid, tl.load(weights_ptr + row).to(tl.float32), 0.0)
    y = _gemv(act_ptr + row.to(tl.int64) * I, 1, valid, w_ptr + e * stride_we, rows, stride_wn, stride_wk,
              s_ptr + e * stride_se, stride_sn, stride_sg, gs_ptr + e, I, BLOCK_N, BLOCK_K, FP4, GROUP,
              SCALE_E8M0, HAS_GLOBAL, DT, INTERPRET)
    ws = ws_ptr + t.to(tl.int64) * (TOP_K * H) + offs_n
    tl.store(ws + j * H, weight * y, mask=offs_n < H)
    tl.debug_barrier()  # every thread's partial is issued before the (release) arrival
    sem = sem_ptr + t * tl.num_programs(1) + tl.program_id(1)
    if tl.atomic_add(sem, 1, sem="acq_rel", scope="gpu") == TOP_K - 1:
        tl.atomic_xchg(sem, 0, sem="relaxed", scope="gpu")
        acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
        for jj in tl.static_range(TOP_K):
            acc += tl.load(ws + jj * H, mask=offs_n < H, other=0.0, cache_modifier=".cg")
        tl.store(out_ptr + t.to(tl.int64) * H + offs_n, cast(acc, DT, INTERPRET), mask=offs_n < H)


# ------------------------------------------------------------------------------------ prefill path
@triton.jit(do_not_specialize=["n_rows"])
def _grouped_gate_up_kernel(
    x_ptr, rows_ptr, block_expert_ptr, act_ptr, n_rows, stride_xt, stride_xk,
    w_ptr, s_ptr, gs_ptr, stride_we, stride_wn, stride_wk, stride_se, stride_sn, stride_sg,
    E: tl.constexpr, H: tl.constexpr, I: tl.constexpr, TOP_K: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, FP4: tl.constexpr, GROUP: tl.constexpr,
    SCALE_E8M0: tl.constexpr, HAS_GLOBAL: tl.constexpr, DOT_PRECISION: tl.constexpr, INTERPRET: tl.constexpr,
):
    """Program (block, n tile): ``act[rows, n tile]`` for the block's ``BLOCK_M`` rows, one expert."""
    DT: tl.constexpr = x_ptr.dtype.element_ty
    pid_m = tl.program_id(0)
    e = tl.load(block_expert_ptr + pid_m)
    if e >= E:  # past the last expert's padded rows
        return
    e = e.to(tl.int64)
    rows_m = tl.load(rows_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
    m_mask = rows_m < n_rows  # padding rows hold n_rows
    x_off = (tl.where(m_mask, rows_m, 0) // TOP_K).to(tl.int64) * stride_xt
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    rows = tl.minimum(offs_n, I - 1)
    w_e = w_ptr + e * stride_we
    s_e = s_ptr + e * stride_se
    gate = _gemm(x_ptr, x_off, m_mask, stride_xk, w_e, rows, stride_wn, stride_wk, s_e, stride_sn, stride_sg,
                 gs_ptr + 2 * e, H, BLOCK_M, BLOCK_N, BLOCK_K, FP4, GROUP, SCALE_E8M0, HAS_GLOBAL, DT, DOT_PRECISION,
                 INTERPRET)
    up = _gemm(x_ptr, x_off, m_mask, stride_xk, w_e + I * stride_wn, rows, stride_wn, stride_wk, s_e + I * stride_sn,
               stride_sn, stride_sg, gs_ptr + 2 * e + 1, H, BLOCK_M, BLOCK_N, BLOCK_K, FP4, GROUP, SCALE_E8M0,
               HAS_GLOBAL, DT, DOT_PRECISION, INTERPRET)
    dst = act_ptr + rows_m.to(tl.int64)[:, None] * I + offs_n[None, :]
    tl.store(dst, _silu_mul(gate, up, DT, INTERPRET), mask=m_mask[:, None] & (offs_n < I)[None, :])


@triton.jit(do_not_specialize=["n_rows"])
def _grouped_down_kernel(
    act_ptr, rows_ptr, block_expert_ptr, y_ptr, n_rows,
    w_ptr, s_ptr, gs_ptr, stride_we, stride_wn, stride_wk, stride_se, stride_sn, stride_sg,
    E: tl.constexpr, H: tl.constexpr, I: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, FP4: tl.constexpr, GROUP: tl.constexpr,
    SCALE_E8M0: tl.constexpr, HAS_GLOBAL: tl.constexpr, DOT_PRECISION: tl.constexpr, INTERPRET: tl.constexpr,
):
    """Program (block, n tile): float32 ``y[rows, n tile] = act[rows] @ down_e.T`` (not rounded)."""
    DT: tl.constexpr = act_ptr.dtype.element_ty
    pid_m = tl.program_id(0)
    e = tl.load(block_expert_ptr + pid_m)
    if e >= E:
        return
    e = e.to(tl.int64)
    rows_m = tl.load(rows_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
    m_mask = rows_m < n_rows
    x_off = tl.where(m_mask, rows_m, 0).to(tl.int64) * I
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    rows = tl.minimum(offs_n, H - 1)
    y = _gemm(act_ptr, x_off, m_mask, 1, w_ptr + e * stride_we, rows, stride_wn, stride_wk, s_ptr + e * stride_se,
              stride_sn, stride_sg, gs_ptr + e, I, BLOCK_M, BLOCK_N, BLOCK_K, FP4, GROUP, SCALE_E8M0, HAS_GLOBAL, DT,
              DOT_PRECISION, INTERPRET)
    dst = y_ptr + rows_m.to(tl.int64)[:, None] * H + offs_n[None, :]
    tl.store(dst, y, mask=m_mask[:, None] & (offs_n < H)[None, :])


@triton.jit
def _slot_sum_kernel(y_ptr, ids_ptr, weights_ptr, out_ptr, E: tl.constexpr, H: tl.constexpr, TOP_K: tl.constexpr,
                     BLOCK: tl.constexpr, INTERPRET: tl.constexpr):
    """Program (token t, tile): ``out[t] = round(sum_j weight[t, j] * y[t * TOP_K + j])``, j in order."""
    t = tl.program_id(0)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < H
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for j in tl.static_range(TOP_K):
        row = t * TOP_K + j
        _, valid = _expert(ids_ptr, row, E)
        weight = tl.where(valid, tl.load(weights_ptr + row).to(tl.float32), 0.0)
        acc += weight * tl.load(y_ptr + row.to(tl.int64) * H + offs, mask=offs < tl.where(valid, H, 0), other=0.0)
    tl.store(out_ptr + t.to(tl.int64) * H + offs, cast(acc, out_ptr.dtype.element_ty, INTERPRET), mask=mask)


@triton.jit(do_not_specialize=["n"])
def _expert_count_kernel(ids_ptr, counts_ptr, n, BLOCK: tl.constexpr):
    """Program e: how many of the ``n`` flattened ids are ``e``."""
    e = tl.program_id(0)
    acc = tl.zeros((BLOCK,), dtype=tl.int32)
    for s in range(0, n, BLOCK):
        offs = s + tl.arange(0, BLOCK)
        acc += (tl.load(ids_ptr + offs, mask=offs < n, other=-1) == e).to(tl.int32)
    tl.store(counts_ptr + e, tl.sum(acc, axis=0))


@triton.jit(do_not_specialize=["n", "blocks"])
def _align_kernel(ids_ptr, counts_ptr, rows_ptr, block_expert_ptr, n, blocks, E: tl.constexpr, E_POW2: tl.constexpr,
                  BLOCK_M: tl.constexpr, BLOCK: tl.constexpr):
    """Program e: expert e's padded segment of ``rows`` (its rows in (token, slot) order, then ``n``) starting
    after the padded counts of the experts before it, and its blocks' ``block_expert``; the last program also
    writes the tail past the used blocks (rows ``n``, experts ``E``)."""
    e = tl.program_id(0)
    ex = tl.arange(0, E_POW2)
    counts = tl.load(counts_ptr + ex, mask=ex < E, other=0)
    padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    start = tl.sum(tl.where(ex < e, padded, 0), axis=0)
    count = tl.sum(tl.where(ex == e, counts, 0), axis=0)
    mine = tl.sum(tl.where(ex == e, padded, 0), axis=0)
    seen = count * 0
    for s in range(0, n, BLOCK):
        offs = s + tl.arange(0, BLOCK)
        match = (tl.load(ids_ptr + offs, mask=offs < n, other=-1) == e).to(tl.int32)
        tl.store(rows_ptr + start + seen + tl.cumsum(match, axis=0) - 1, offs, mask=match > 0)
        seen += tl.sum(match, axis=0)
    pad = tl.arange(0, BLOCK_M)
    tl.store(rows_ptr + start + count + pad, n + pad * 0, mask=count + pad < mine)
    for b0 in range(0, blocks, BLOCK):
        b = b0 + tl.arange(0, BLOCK)
        tl.store(block_expert_ptr + b, e + b * 0, mask=(b * BLOCK_M >= start) & (b * BLOCK_M < start + mine))
    if e == E - 1:  # past the used blocks: no expert
        used = start + mine
        for r0 in range(0, blocks * BLOCK_M, BLOCK):
            r = r0 + tl.arange(0, BLOCK)
            tl.store(rows_ptr + r, n + r * 0, mask=(r >= used) & (r < blocks * BLOCK_M))
        for b0 in range(0, blocks, BLOCK):
            b = b0 + tl.arange(0, BLOCK)
            tl.store(block_expert_ptr + b, E + b * 0, mask=(b * BLOCK_M >= used) & (b < blocks))


def _align_blocks(n: int, num_experts: int, block_m: int) -> int:
    """The host-int bound on the blocks the grouping fills: ``T * k / BLOCK_M + E`` at most."""
    return (n + min(num_experts, n) * (block_m - 1)) // block_m


def _align(ids: torch.Tensor, num_experts: int, block_m: int) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Rows ``t * k + j`` grouped by expert, each expert's group padded to a multiple of ``block_m``.

    Returns ``rows`` int32 ``[blocks * block_m]`` (padding: ``n = T * k``), ``block_expert`` int32
    ``[blocks]`` (E past the used blocks) and ``blocks``, a host-int upper bound. Two launches (a count per
    expert, then each expert's segment), deterministic (an expert's rows stay in (token, slot) order, no
    atomics); invalid ids match no expert and land in no block. ``_align_ref`` is the same in torch ops.
    """
    n, blocks = ids.numel(), _align_blocks(ids.numel(), num_experts, block_m)
    flat = ids.reshape(-1)
    counts = torch.empty(num_experts, dtype=torch.int32, device=ids.device)
    rows = torch.empty(blocks * block_m, dtype=torch.int32, device=ids.device)
    block_expert = torch.empty(blocks, dtype=torch.int32, device=ids.device)
    block = min(1024, triton.next_power_of_2(max(n, blocks * block_m, 16)))
    _expert_count_kernel[(num_experts,)](flat, counts, n, BLOCK=block)
    _align_kernel[(num_experts,)](flat, counts, rows, block_expert, n, blocks, E=num_experts,
                                  E_POW2=triton.next_power_of_2(num_experts), BLOCK_M=block_m, BLOCK=block)
    return rows, block_expert, blocks


def _align_ref(ids: torch.Tensor, num_experts: int, block_m: int) -> tuple[torch.Tensor, torch.Tensor, int]:
    """``_align`` in torch ops (a stable sort, searchsorted, cumsum and gathers; no scatter): the reference."""
    n, dev = ids.numel(), ids.device
    blocks = _align_blocks(n, num_experts, block_m)
    flat = ids.reshape(-1).long()
    sorted_key, order = torch.sort(torch.where((flat >= 0) & (flat < num_experts), flat, num_experts), stable=True)
    start = torch.searchsorted(sorted_key, torch.arange(num_experts + 1, device=dev))  # [E + 1]
    count = start[1:] - start[:-1]
    padded = (count + block_m - 1) // block_m * block_m
    padded_end = torch.cumsum(padded, 0)
    block_expert = torch.searchsorted(padded_end, torch.arange(blocks, device=dev) * block_m, right=True)
    # Slot p of block b = p // block_m holds its expert's row number p - padded_start[e], if below count[e].
    zero = count.new_zeros(1)
    e_p = block_expert.repeat_interleave(block_m)
    rank = torch.arange(blocks * block_m, device=dev) - torch.cat((padded_end - padded, zero))[e_p]
    used = rank < torch.cat((count, zero))[e_p]
    rows = torch.where(used, order[(start[e_p] + rank).clamp(max=n - 1)], n)
    return rows.to(torch.int32), block_expert.to(torch.int32), blocks


# ------------------------------------------------------------------------------------------ host side
@attrs.frozen
class _Proj:
    """One projection's launch operands: the weight (dense, or FP4 packed bytes), its raw scale
    bytes and float32 global scales (None when absent: the weight's pointer stands in, unread)."""

    w: torch.Tensor
    scale: torch.Tensor | None = None
    global_scale: torch.Tensor | None = None

    def args(self, words: bool = False) -> tuple:
        """(w, scale, global, w's [E, N, K] strides, scale's [E, N, G] strides) as the kernels take them;
        ``words``: FP4 packed bytes as int32 words of 8 codes (the decode path)."""
        w = self.w.view(torch.int32) if words and self.scale is not None else self.w
        s = self.w if self.scale is None else self.scale
        g = self.w if self.global_scale is None else self.global_scale
        return (w, s, g, *w.stride(), *(s.stride() if self.scale is not None else (0, 0, 0)))


def _fail(name: str, t: torch.Tensor, expected: str) -> ValueError:
    return ValueError(f"fused_experts: {name} has shape {tuple(t.shape)} and dtype {t.dtype} on {t.device}; "
                      f"expected {expected}")


def _check(name: str, t: torch.Tensor, what: str, shape: tuple[int, ...], dtypes: tuple[torch.dtype, ...],
           device: torch.device) -> None:
    if tuple(t.shape) != shape or t.dtype not in dtypes or t.device != device:
        names = " or ".join(str(d).removeprefix("torch.") for d in dtypes)
        raise _fail(name, t, f"{what} = {shape} of {names} on {device}")


def _fp4_projs(fp4: FP4Experts, e: int, i: int, h: int, device: torch.device) -> tuple[_Proj, _Proj]:
    if fp4.scale_kind not in ("e4m3", "e8m0"):
        raise ValueError(f"fused_experts: fp4.scale_kind={fp4.scale_kind!r}, expected 'e4m3' or 'e8m0'")
    g = fp4.group_size
    if g < 8 or g & (g - 1) or h % g or i % g:
        raise ValueError(f"fused_experts: fp4.group_size={g}, expected a power of two >= 8 dividing H={h} and I={i}")
    scale_dtypes = (torch.uint8,) if fp4.scale_kind == "e8m0" else (torch.float8_e4m3fn, torch.uint8)
    projs = []
    for which, dims, shape, n_global in (("gate_up", ("E", "2I", "H"), (e, 2 * i, h), 2),
                                         ("down", ("E", "H", "I"), (e, h, i), 1)):
        packed, scale = getattr(fp4, f"{which}_packed"), getattr(fp4, f"{which}_scale")
        glob = getattr(fp4, f"{which}_global_scale")
        n_exp, rows, k = shape
        _check(f"fp4.{which}_packed", packed, f"[{dims[0]}, {dims[1]}, {dims[2]}/2]", (n_exp, rows, k // 2),
               (torch.uint8,), device)
        _check(f"fp4.{which}_scale", scale, f"[{dims[0]}, {dims[1]}, {dims[2]}/{g}]", (n_exp, rows, k // g),
               scale_dtypes, device)
        if glob is not None:
            if fp4.scale_kind == "e8m0":
                raise ValueError(f"fused_experts: fp4.{which}_global_scale is given, but MXFP4 (e8m0) has none")
            _check(f"fp4.{which}_global_scale", glob, f"[E, {n_global}]", (n_exp, n_global), (torch.float32,), device)
            glob = glob.contiguous()
        projs.append(_Proj(packed, scale.view(torch.uint8), glob))
    return projs[0], projs[1]


def _operands(x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, w_gate_up: torch.Tensor | None,
              w_down: torch.Tensor | None, fp4: FP4Experts | None) -> tuple[int, int, _Proj, _Proj]:
    """Validate :func:`fused_experts`' operands (host-side shapes, dtypes, devices); (E, I, gate_up, down)."""
    if x.dim() != 2 or x.dtype not in _DTYPES:
        raise _fail("x", x, "[T, H] of bfloat16, float16 or float32")
    t, h = x.shape
    dense = (w_gate_up is not None, w_down is not None)
    if dense != ((fp4 is None),) * 2:
        raise ValueError("fused_experts: expected dense w_gate_up and w_down, or both None and fp4=FP4Experts(...)")
    w3 = w_gate_up if fp4 is None else fp4.gate_up_packed
    if w3.dim() != 3 or w3.shape[1] % 2:
        raise _fail("w_gate_up" if fp4 is None else "fp4.gate_up_packed", w3, "[E, 2I, H] (packed: [E, 2I, H/2])")
    e, i = w3.shape[0], w3.shape[1] // 2
    if fp4 is None:
        _check("w_gate_up", w_gate_up, "[E, 2I, H]", (e, 2 * i, h), (x.dtype,), x.device)
        _check("w_down", w_down, "[E, H, I]", (e, h, i), (x.dtype,), x.device)
        gate_up, down = _Proj(w_gate_up), _Proj(w_down)
    else:
        gate_up, down = _fp4_projs(fp4, e, i, h, x.device)
    k = topk_ids.shape[-1]
    if topk_ids.dim() != 2 or not 1 <= k <= e:
        raise _fail("topk_ids", topk_ids, f"[T, k] with T={t} and 1 <= k <= E={e}")
    _check("topk_ids", topk_ids, "[T, k]", (t, k), (torch.int32, torch.int64), x.device)
    _check("topk_weights", topk_weights, "[T, k]", (t, k), _DTYPES, x.device)
    return e, i, gate_up, down


def _pow2(name: str, v: int, low: int) -> None:
    if v < low or v & (v - 1):
        raise ValueError(f"fused_experts: {name}={v}, expected a power of two >= {low}")


@functools.cache
def _decode_blocks(n: int, k: int, itemsize: int, group: int, programs_per_tile: int, sms: int) -> tuple[int, int]:
    """(BLOCK_N, BLOCK_K) of a decode GEMV over ``n`` rows of length ``k`` (``programs_per_tile``
    programs share each n tile: T * top_k). Dense: 16 rows a program and ~8 KB of weight a step (bf16:
    256 columns). FP4 (``group`` > 0): 256 columns (128 bytes a row) and the widest of 32, 16, 8 rows
    giving >= 3 programs an SM (the launches are latency-bound; the sweep: docs/BENCHMARKS.md, issue
    9). K blocks stay within next_pow2(k) and, for FP4, hold whole groups."""
    bk = 256 if group else _GEMV_TILE_BYTES // (16 * itemsize)
    bn = 16
    if group:
        bn = next((b for b in (32, 16) if programs_per_tile * triton.cdiv(n, b) >= 3 * sms), 8)
    return min(bn, triton.next_power_of_2(n)), max(group, 16, min(bk, triton.next_power_of_2(k)))


@functools.cache
def _prefill_blocks(n: int, k: int, group: int) -> tuple[int, int]:
    """(BLOCK_N, BLOCK_K) of a grouped GEMM (BLOCK_M is 64): 64 x 64 tiles (FP4: K 128, as
    ``fp4_gemm``), never below ``tl.dot``'s 16 (FP4: 32, two 16-wide halves)."""
    bn = max(16, min(64, triton.next_power_of_2(n)))
    return bn, max(32 if group else 16, group, min(128 if group else 64, triton.next_power_of_2(k)))


def fused_experts(
    x: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    w_gate_up: torch.Tensor | None,
    w_down: torch.Tensor | None,
    *,
    fp4: FP4Experts | None = None,
    path: Literal["decode", "prefill"] | None = None,
    block_m: int | None = None,
    block_n: int | None = None,
    block_k: int | None = None,
) -> torch.Tensor:
    """The routed experts' SwiGLU MLPs summed with their weights: ``[T, H]`` in ``x``'s dtype (see
    the module docstring for the exact rounding; :func:`fused_experts_ref` is the reference).

    ``x`` [T, H] (bf16 / fp16 / fp32; any strides); ``topk_ids`` int32/int64 [T, k];
    ``topk_weights`` [T, k] (float32 or 16-bit); dense ``w_gate_up`` [E, 2I, H] (gate rows, then up
    rows) and ``w_down`` [E, H, I] of ``x``'s dtype, or both None and ``fp4`` given. Ids outside
    [0, E) contribute nothing. ``path``: "decode" (the default for T <= 16) or "prefill". ``block_*``
    force tile sizes, powers of two (prefill: ``block_m``, ``block_n`` >= 16; ``block_k`` >= 16,
    FP4 a multiple of the group and >= 32); by default ``_decode_blocks`` / ``_prefill_blocks``
    (BLOCK_M 64) pick them. Raises ValueError naming the operand and its expected shape.
    """
    e, i, gate_up, down = _operands(x, topk_ids, topk_weights, w_gate_up, w_down, fp4)
    (t, h), k = x.shape, topk_ids.shape[1]
    group = 0 if fp4 is None else fp4.group_size
    if path is None:
        path = "decode" if t <= _DECODE_MAX_T else "prefill"
    if path not in ("decode", "prefill"):
        raise ValueError(f"fused_experts: path={path!r}, expected 'decode' or 'prefill'")
    if path == "decode":
        sms = num_sms(x.device)
        blocks = [_decode_blocks(n, kk, x.element_size(), group, t * k, sms)
                  for n, kk in ((i, h), (h, i))]
    else:
        blocks = [_prefill_blocks(n, kk, group) for n, kk in ((i, h), (h, i))]
        _pow2("block_m", block_m or 64, 16)
    (bn1, bk1), (bn2, bk2) = blocks = [(block_n or bn, block_k or bk) for bn, bk in blocks]
    for bn, bk in blocks:
        _pow2("block_n", bn, 1 if path == "decode" else 16)
        _pow2("block_k", bk, max(group, 1) if path == "decode" else max(group, 32 if group else 16))

    out = torch.empty((t, h), dtype=x.dtype, device=x.device)
    if t == 0:
        return out
    ids, weights = topk_ids.contiguous(), topk_weights.contiguous()
    act = torch.empty((t * k, i), dtype=x.dtype, device=x.device)
    meta = dict(E=e, H=h, I=i, FP4=fp4 is not None, GROUP=max(group, 1),
                SCALE_E8M0=fp4 is not None and fp4.scale_kind == "e8m0",
                HAS_GLOBAL=gate_up.global_scale is not None, INTERPRET=INTERPRET, num_warps=4, enable_fp_fusion=True)
    if path == "decode":
        _decode_gate_up_kernel[(t * k, triton.cdiv(i, bn1))](
            x, ids, act, x.stride(0), x.stride(1), *gate_up.args(words=True), TOP_K=k, BLOCK_N=bn1, BLOCK_K=bk1,
            **meta)
        n_tiles = triton.cdiv(h, bn2)
        ws = torch.empty((t, k, h), dtype=torch.float32, device=x.device)
        _decode_down_kernel[(t, n_tiles, k)](
            act, ids, weights, out, ws, arrival_counters(x.device, t * n_tiles), *down.args(words=True), TOP_K=k,
            BLOCK_N=bn2, BLOCK_K=bk2, **meta)
        return out

    bm = block_m or 64
    rows, block_expert, n_blocks = _align(ids, e, bm)
    meta.update(BLOCK_M=bm, DOT_PRECISION="ieee" if x.dtype == torch.float32 else "tf32")  # tf32: moot for 16-bit
    _grouped_gate_up_kernel[(n_blocks, triton.cdiv(i, bn1))](
        x, rows, block_expert, act, t * k, x.stride(0), x.stride(1), *gate_up.args(),
        TOP_K=k, BLOCK_N=bn1, BLOCK_K=bk1, **meta)
    y = torch.empty((t * k, h), dtype=torch.float32, device=x.device)
    _grouped_down_kernel[(n_blocks, triton.cdiv(h, bn2))](
        act, rows, block_expert, y, t * k, *down.args(), BLOCK_N=bn2, BLOCK_K=bk2, **meta)
    block = min(1024, triton.next_power_of_2(h))
    _slot_sum_kernel[(t, triton.cdiv(h, block))](y, ids, weights, out, E=e, H=h, TOP_K=k, BLOCK=block,
                                                 INTERPRET=INTERPRET, num_warps=4, enable_fp_fusion=True)
    return out


def _ref_weight(dense: torch.Tensor | None, fp4: FP4Experts | None, which: str, e: int, dtype: torch.dtype
                ) -> torch.Tensor:
    """Expert ``e``'s ``which`` weight as the kernels see it, in float32: dense as is; FP4 decoded
    in float32 (``dequantize_fp4``, per-row globals as ``Experts._fp4`` builds them) rounded to ``dtype``
    (float32 for the decode path, which rounds no weight)."""
    if fp4 is None:
        return dense[e].float()
    packed, scale = getattr(fp4, f"{which}_packed")[e], getattr(fp4, f"{which}_scale")[e]
    glob = getattr(fp4, f"{which}_global_scale")
    row_global = None if glob is None else glob[e].repeat_interleave(packed.shape[0] // glob.shape[1])
    return dequantize_fp4(packed, group_scales(scale, fp4.scale_kind, row_global), fp4.group_size).to(dtype).float()


def fused_experts_ref(
    x: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    w_gate_up: torch.Tensor | None,
    w_down: torch.Tensor | None,
    *,
    fp4: FP4Experts | None = None,
    path: Literal["decode", "prefill"] = "prefill",
) -> torch.Tensor:
    """Torch reference of :func:`fused_experts` on ``path``: plain loops over tokens and slots, with
    the same rounding points (module docstring) and no validation; it syncs, being a reference."""
    wdtype = torch.float32 if path == "decode" else x.dtype
    n_exp = (w_gate_up if fp4 is None else fp4.gate_up_packed).shape[0]
    out = torch.empty_like(x)
    for t in range(x.shape[0]):
        acc = torch.zeros(x.shape[1], dtype=torch.float32, device=x.device)
        for j in range(topk_ids.shape[1]):
            e = int(topk_ids[t, j])
            if not 0 <= e < n_exp:
                continue
            gate_up = (x[t].float() @ _ref_weight(w_gate_up, fp4, "gate_up", e, wdtype).T).to(x.dtype)
            gate, up = gate_up.chunk(2)
            y = (F.silu(gate) * up).float() @ _ref_weight(w_down, fp4, "down", e, wdtype).T
            acc = acc + topk_weights[t, j].float() * y
        out[t] = acc.to(x.dtype)
    return out
