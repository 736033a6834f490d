"""Gated DeltaNet (Qwen3.5's linear attention) in Triton: a fused decode step and a chunked prefill.

The math is :mod:`vtcore.layers.gated_delta`'s (its docstring states it) and, for the decode step,
:class:`vtcore.layers.gated_deltanet.GatedDeltaNet`'s per-token path; everything runs in float32.
Per head, with the state S [Dk, Dv], decay a_t = exp(g_t) and write strength b_t:

    S_t = a_t S_{t-1} + k_t d_t^T,   d_t = b_t (v_t - a_t S_{t-1}^T k_t),   o_t = S_t^T q_t

Decode (:func:`gdn_decode_step`, rows of Q tokens: one for a decode step, a verify row's fed token
and its draft under speculative decoding; two launches):

* ``_decode_conv_kernel``, program (row, segment), a segment being one q head, k head or v head
  of the pre-conv projection: per token, the causal depthwise conv over the K-1 inputs before it (the
  slot's conv state, zeros when the row has no state, then the row's earlier tokens) and its own,
  SiLU, and for q/k the l2 norm ``x * rsqrt(sum(x^2) + 1e-6)`` (q also times Dk^-0.5). It writes the
  activations to a float32 ``[B*Q, conv_dim]`` scratch and, per token, the conv state after it (the
  last K-1 inputs) to the token's out slot (a decode row's own). The K-1 state columns are handled as
  K-1 separate channel vectors, so the thread that reads a channel's state is the one that rewrites
  it (no cross-thread read-after-write hazard inside the program).
* ``_decode_recurrent_kernel``, program (row, v head, Dv tile): loads the [Dk, BLOCK_DV] state tile
  of the slot (zeros without state) into registers; per token computes g = -exp(A_log) *
  softplus(a + dt_bias) (torch's softplus: linear above 20) and beta = sigmoid(b), applies one step
  of the rule with q/k head ``h // (Hv / Hk)`` and stores the tile to the token's out slot.

Slots and has_state are device tensors and the launch sizes depend on host ints only (shapes and
the SM count), so the step can be captured in a CUDA graph; padded rows of a graph batch point at a
dummy slot and just compute garbage there (a padded decode row writes it; a padded verify row has no
out slots), and a verify row's padded tokens have no out slot (-1), so they write nothing. The
scratch is a caching-allocator ``torch.empty`` (from the graph's pool under capture).

Prefill (:func:`chunk_gated_delta_rule`, a drop-in for ``gated_delta_chunked``; three launches, as
in flash-linear-attention's ``chunk_gated_delta_rule``). Tokens are cut into chunks of C; the tail
chunk is padded in registers with g = 0, beta = 0, k = q = v = 0, which neither reads nor changes
the state. With ``cum`` the chunk-local cumsum of g (log G_t):

* ``_chunk_prepare_kernel``, program (chunk, head): A = beta_t (K K^T)_{ti} exp(cum_t - cum_i),
  strictly lower; T = (I + A)^{-1} by forward substitution over the rows of X = T - I
  (x_i = -A_i - sum_{j<i} A_ij x_j, one [C, C] register update per row); then
  u = T (beta * V) and w = T (beta * exp(cum) * K) by ``tl.dot``. Writes u, w and cum to float32
  scratch laid out per head ([H, T_pad, D]), so the next kernel walks them contiguously.
* ``_chunk_state_kernel``, program (head, Dv tile), sequential over the chunks: holds S
  [Dk, BLOCK_DV] in registers; per chunk stores S (the chunk's initial state, read by the output
  kernel), computes v_new = u - w S (overwriting u) and S <- exp(cum_C) S + (K exp(cum_C - cum))^T
  v_new; finally writes the new state.
* ``_chunk_output_kernel``, program (chunk, head, Dv tile):
  o = (Q exp(cum)) S_n + (Q K^T * exp(cum_t - cum_i), causal including the diagonal) v_new.

Scratch: u/v_new and w (T_pad * H * (Dk + Dv) floats) and the per-chunk states, H * ceil(T/C) * Dk *
Dv floats (2 MiB per chunk of 64 tokens for 32 heads of 128 x 128): the caller bounds T per call.
The dots run with ``input_precision="ieee"`` (true float32, no TF32), matching the float32 torch
reference to ~1e-6 relative.

Launch configs come from host ints (``_decode_block_dv``, ``_chunk_config``); ``block_dv`` forces
the Dv tile (a power of two; >= 16 for the chunked kernels, whose ``tl.dot`` needs it).
"""
from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from vtcore.kernels.device import num_sms
from vtcore.kernels.helpers import INTERPRET

__all__ = ["gdn_decode_step", "chunk_gated_delta_rule"]

_FLOATS = (torch.bfloat16, torch.float16, torch.float32)
_F32 = (torch.float32,)
_L2_EPS = 1e-6  # vtcore.layers.gated_delta.l2_normalize's
_SOFTPLUS_THRESHOLD = 20.0  # torch.nn.functional.softplus's default: linear above it
_PROGRAMS_PER_SM = 2  # the Dv tiling aims for this many programs per SM


# ------------------------------------------------------------------------------------------ decode
@triton.jit
def _decode_conv_kernel(
    x_ptr, w_ptr, conv_ptr, slots_ptr, out_slots_ptr, has_state_ptr, qkv_ptr,
    stride_x, stride_wc, stride_wk, q_scale,
    HK: tl.constexpr, HV: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr, KERNEL: tl.constexpr,
    BLOCK_D: tl.constexpr, EPS: tl.constexpr, Q: tl.constexpr,
):
    """Program (row, segment): segments 0..HK-1 are q heads, HK..2HK-1 k heads, then HV v heads; the
    row's Q tokens in turn."""
    row = tl.program_id(0)
    seg = tl.program_id(1)
    CONV_DIM: tl.constexpr = 2 * HK * DK + HV * DV
    is_qk = seg < 2 * HK
    base = tl.where(is_qk, seg * DK, 2 * HK * DK + (seg - 2 * HK) * DV)
    offs = tl.arange(0, BLOCK_D)
    width = tl.where(is_qk, DK, DV)
    mask = offs < width
    ch = base + offs
    slot = tl.load(slots_ptr + row)
    # Without state the prior inputs are zeros: no channel of the slot is read.
    state_mask = offs < tl.where(tl.load(has_state_ptr + row) != 0, width, 0)
    state_ptrs = conv_ptr + slot * (CONV_DIM * (KERNEL - 1)) + ch * (KERNEL - 1)
    x_ptrs = x_ptr + (row * Q).to(tl.int64) * stride_x + ch
    # Token t's window is inputs t-K+1..t (input i < 0: the slot's state column K-1+i); the state after it,
    # inputs t-K+2..t, goes to its out slot (-1: none) as they are read. Only the row's last real token's out
    # slot may be its own slot, and the tokens after it are padding: column c is written after every read of
    # it that a real token makes (its own reads go to columns past c, by the same thread).
    for t in tl.static_range(Q):
        out_slot = tl.load(out_slots_ptr + row * Q + t)
        out_ptrs = conv_ptr + out_slot * (CONV_DIM * (KERNEL - 1)) + ch * (KERNEL - 1)
        written = offs < tl.where(out_slot >= 0, width, 0)
        x = tl.load(x_ptrs + t * stride_x, mask=mask, other=0.0).to(tl.float32)
        y = x * tl.load(w_ptr + ch * stride_wc + (KERNEL - 1) * stride_wk, mask=mask, other=0.0).to(tl.float32)
        for j in tl.static_range(KERNEL - 1):
            if t + j < KERNEL - 1:
                v = tl.load(state_ptrs + (t + j), mask=state_mask, other=0.0)
            else:
                v = tl.load(x_ptrs + (t + j - (KERNEL - 1)) * stride_x, mask=mask, other=0.0).to(tl.float32)
            y += v * tl.load(w_ptr + ch * stride_wc + j * stride_wk, mask=mask, other=0.0).to(tl.float32)
            if j > 0:
                tl.store(out_ptrs + (j - 1), v, mask=written)
        tl.store(out_ptrs + (KERNEL - 2), x, mask=written)
        y = y * tl.sigmoid(y)
        rstd = tl.rsqrt(tl.sum(y * y, axis=0) + EPS)
        factor = tl.where(is_qk, rstd, 1.0) * tl.where(seg < HK, q_scale, 1.0)
        tl.store(qkv_ptr + (row * Q + t) * CONV_DIM + ch, y * factor, mask=mask)


@triton.jit
def _decode_recurrent_kernel(
    qkv_ptr, a_ptr, b_ptr, a_log_ptr, dt_bias_ptr, state_ptr, slots_ptr, out_slots_ptr, has_state_ptr, out_ptr,
    stride_a, stride_b,
    HK: tl.constexpr, HV: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr,
    BLOCK_DK: tl.constexpr, BLOCK_DV: tl.constexpr, THRESHOLD: tl.constexpr, Q: tl.constexpr,
):
    """Program (row, v head, Dv tile): the row's Q tokens in turn on the slot's [Dk, BLOCK_DV] state tile,
    held in registers; the tile after token t is stored to its out slot (-1: none)."""
    row = tl.program_id(0)
    h = tl.program_id(1)
    pid_v = tl.program_id(2)
    CONV_DIM: tl.constexpr = 2 * HK * DK + HV * DV
    kh = h // (HV // HK)
    offs_k = tl.arange(0, BLOCK_DK)
    offs_v = pid_v * BLOCK_DV + tl.arange(0, BLOCK_DV)
    k_mask = offs_k < DK
    v_mask = offs_v < DV
    neg_a = -tl.exp(tl.load(a_log_ptr + h).to(tl.float32))
    dt_bias = tl.load(dt_bias_ptr + h).to(tl.float32)
    slot = tl.load(slots_ptr + row)
    tile = offs_k[:, None] * DV + offs_v[None, :]
    # Without state the prior state is zeros: no row of the slot's tile is read.
    keep_rows = offs_k < tl.where(tl.load(has_state_ptr + row) != 0, DK, 0)
    s = tl.load(state_ptr + slot * (HV * DK * DV) + h * (DK * DV) + tile, mask=keep_rows[:, None] & v_mask[None, :],
                other=0.0)
    for t in tl.static_range(Q):
        r = row * Q + t
        qkv_row = qkv_ptr + r * CONV_DIM
        q = tl.load(qkv_row + kh * DK + offs_k, mask=k_mask, other=0.0)
        k = tl.load(qkv_row + HK * DK + kh * DK + offs_k, mask=k_mask, other=0.0)
        v = tl.load(qkv_row + 2 * HK * DK + h * DV + offs_v, mask=v_mask, other=0.0)
        x = tl.load(a_ptr + r * stride_a + h).to(tl.float32) + dt_bias
        softplus = tl.where(x > THRESHOLD, x, tl.log(1.0 + tl.exp(tl.minimum(x, THRESHOLD))))
        beta = tl.sigmoid(tl.load(b_ptr + r * stride_b + h).to(tl.float32))
        s = s * tl.exp(neg_a * softplus)
        delta = (v - tl.sum(s * k[:, None], axis=0)) * beta
        s += k[:, None] * delta[None, :]
        out_slot = tl.load(out_slots_ptr + r)
        written = offs_k < tl.where(out_slot >= 0, DK, 0)
        tl.store(state_ptr + out_slot * (HV * DK * DV) + h * (DK * DV) + tile, s,
                 mask=written[:, None] & v_mask[None, :])
        tl.store(out_ptr + (r * HV + h) * DV + offs_v, tl.sum(s * q[:, None], axis=0), mask=v_mask)


# ----------------------------------------------------------------------------------------- prefill
@triton.jit(do_not_specialize=["T"])
def _chunk_prepare_kernel(
    k_ptr, v_ptr, g_ptr, beta_ptr, u_ptr, w_ptr, cum_ptr, T, T_PAD,
    stride_kt, stride_kh, stride_kd, stride_vt, stride_vh, stride_vd, stride_gt, stride_gh, stride_bt, stride_bh,
    DK: tl.constexpr, DV: tl.constexpr, CHUNK: tl.constexpr, BLOCK_DK: tl.constexpr, BLOCK_DV: tl.constexpr,
):
    """Program (chunk, head): cum, u = T (beta V), w = T (beta exp(cum) K), T = (I + A)^{-1}."""
    n = tl.program_id(0)
    h = tl.program_id(1)
    rows = tl.arange(0, CHUNK)
    offs_t = n * CHUNK + rows
    t_mask = offs_t < T
    offs_k = tl.arange(0, BLOCK_DK)
    offs_v = tl.arange(0, BLOCK_DV)
    k_mask = offs_k < DK
    v_mask = offs_v < DV
    k = tl.load(k_ptr + offs_t[:, None] * stride_kt + h * stride_kh + offs_k[None, :] * stride_kd,
                mask=t_mask[:, None] & k_mask[None, :], other=0.0).to(tl.float32)
    v = tl.load(v_ptr + offs_t[:, None] * stride_vt + h * stride_vh + offs_v[None, :] * stride_vd,
                mask=t_mask[:, None] & v_mask[None, :], other=0.0).to(tl.float32)
    g = tl.load(g_ptr + offs_t * stride_gt + h * stride_gh, mask=t_mask, other=0.0).to(tl.float32)
    beta = tl.load(beta_ptr + offs_t * stride_bt + h * stride_bh, mask=t_mask, other=0.0).to(tl.float32)
    cum = tl.cumsum(g, axis=0)
    lower = rows[:, None] > rows[None, :]
    decay = tl.exp(tl.where(lower, cum[:, None] - cum[None, :], float("-inf")))
    kk = tl.dot(k, tl.trans(k), input_precision="ieee")
    x = -(kk * decay * beta[:, None])  # -A, strictly lower
    # Forward substitution: row i of X = (I + A)^{-1} - I is -A_i - sum_{j<i} A_ij X_j, rows j < i done.
    for i in range(1, CHUNK):
        sel = (rows == i)[:, None]
        x_i = tl.sum(tl.where(sel, x, 0.0), axis=0)
        x_i += tl.sum(x_i[:, None] * x, axis=0)
        x = tl.where(sel, x_i[None, :], x)
    t_inv = x + (rows[:, None] == rows[None, :]).to(tl.float32)
    u = tl.dot(t_inv, v * beta[:, None], input_precision="ieee")
    w = tl.dot(t_inv, k * (beta * tl.exp(cum))[:, None], input_precision="ieee")
    head_rows = h.to(tl.int64) * T_PAD + offs_t
    tl.store(u_ptr + head_rows[:, None] * DV + offs_v[None, :], u, mask=v_mask[None, :])
    tl.store(w_ptr + head_rows[:, None] * DK + offs_k[None, :], w, mask=k_mask[None, :])
    tl.store(cum_ptr + head_rows, cum)


@triton.jit(do_not_specialize=["T", "NUM_CHUNKS"])
def _chunk_state_kernel(
    k_ptr, u_ptr, w_ptr, cum_ptr, state_ptr, chunk_states_ptr, new_state_ptr, T, T_PAD, NUM_CHUNKS,
    stride_kt, stride_kh, stride_kd,
    DK: tl.constexpr, DV: tl.constexpr, CHUNK: tl.constexpr, BLOCK_DK: tl.constexpr, BLOCK_DV: tl.constexpr,
):
    """Program (head, Dv tile), over the chunks in order: stores each chunk's initial state, turns u
    into v_new = u - w S in place, S <- exp(cum_C) S + (K exp(cum_C - cum))^T v_new."""
    h = tl.program_id(0)
    pid_v = tl.program_id(1)
    rows = tl.arange(0, CHUNK)
    offs_k = tl.arange(0, BLOCK_DK)
    offs_v = pid_v * BLOCK_DV + tl.arange(0, BLOCK_DV)
    k_mask = offs_k < DK
    v_mask = offs_v < DV
    tile = offs_k[:, None] * DV + offs_v[None, :]
    tile_mask = k_mask[:, None] & v_mask[None, :]
    h64 = h.to(tl.int64)
    s = tl.load(state_ptr + h64 * (DK * DV) + tile, mask=tile_mask, other=0.0)
    for n in range(NUM_CHUNKS):
        offs_t = n * CHUNK + rows
        head_rows = h64 * T_PAD + offs_t
        tl.store(chunk_states_ptr + (h64 * NUM_CHUNKS + n) * (DK * DV) + tile, s, mask=tile_mask)
        w = tl.load(w_ptr + head_rows[:, None] * DK + offs_k[None, :], mask=k_mask[None, :], other=0.0)
        u_ptrs = u_ptr + head_rows[:, None] * DV + offs_v[None, :]
        v_new = tl.load(u_ptrs, mask=v_mask[None, :], other=0.0) - tl.dot(w, s, input_precision="ieee")
        tl.store(u_ptrs, v_new, mask=v_mask[None, :])
        cum = tl.load(cum_ptr + head_rows)
        cum_last = tl.load(cum_ptr + h64 * T_PAD + n * CHUNK + CHUNK - 1)
        k = tl.load(k_ptr + offs_t[:, None] * stride_kt + h * stride_kh + offs_k[None, :] * stride_kd,
                    mask=(offs_t < T)[:, None] & k_mask[None, :], other=0.0).to(tl.float32)
        k_to_end = k * tl.exp(cum_last - cum)[:, None]
        s = s * tl.exp(cum_last) + tl.dot(tl.trans(k_to_end), v_new, input_precision="ieee")
    tl.store(new_state_ptr + h64 * (DK * DV) + tile, s, mask=tile_mask)


@triton.jit(do_not_specialize=["T", "NUM_CHUNKS"])
def _chunk_output_kernel(
    q_ptr, k_ptr, v_new_ptr, cum_ptr, chunk_states_ptr, out_ptr, T, T_PAD, NUM_CHUNKS,
    stride_qt, stride_qh, stride_qd, stride_kt, stride_kh, stride_kd,
    H: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr, CHUNK: tl.constexpr,
    BLOCK_DK: tl.constexpr, BLOCK_DV: tl.constexpr,
):
    """Program (chunk, head, Dv tile): o = (Q exp(cum)) S_n + (Q K^T decay, causal) v_new."""
    n = tl.program_id(0)
    h = tl.program_id(1)
    pid_v = tl.program_id(2)
    rows = tl.arange(0, CHUNK)
    offs_t = n * CHUNK + rows
    t_mask = offs_t < T
    offs_k = tl.arange(0, BLOCK_DK)
    offs_v = pid_v * BLOCK_DV + tl.arange(0, BLOCK_DV)
    k_mask = offs_k < DK
    v_mask = offs_v < DV
    qk_mask = t_mask[:, None] & k_mask[None, :]
    q = tl.load(q_ptr + offs_t[:, None] * stride_qt + h * stride_qh + offs_k[None, :] * stride_qd, mask=qk_mask,
                other=0.0).to(tl.float32)
    k = tl.load(k_ptr + offs_t[:, None] * stride_kt + h * stride_kh + offs_k[None, :] * stride_kd, mask=qk_mask,
                other=0.0).to(tl.float32)
    h64 = h.to(tl.int64)
    head_rows = h64 * T_PAD + offs_t
    cum = tl.load(cum_ptr + head_rows)
    s = tl.load(chunk_states_ptr + (h64 * NUM_CHUNKS + n) * (DK * DV) + offs_k[:, None] * DV + offs_v[None, :],
                mask=k_mask[:, None] & v_mask[None, :], other=0.0)
    v_new = tl.load(v_new_ptr + head_rows[:, None] * DV + offs_v[None, :], mask=v_mask[None, :], other=0.0)
    causal = rows[:, None] >= rows[None, :]
    p = tl.dot(q, tl.trans(k), input_precision="ieee") * tl.exp(tl.where(causal, cum[:, None] - cum[None, :],
                                                                          float("-inf")))
    o = tl.dot(q * tl.exp(cum)[:, None], s, input_precision="ieee") + tl.dot(p, v_new, input_precision="ieee")
    tl.store(out_ptr + (offs_t[:, None] * H + h) * DV + offs_v[None, :], o, mask=t_mask[:, None] & v_mask[None, :])


# -------------------------------------------------------------------------------------------- host


def _pick_block_dv(programs_per_tile: int, dv: int, sms: int, floor: int) -> int:
    """The largest Dv tile in (64, 32, 16), at most next_pow2(dv), that gives >= 2 programs per SM
    (``programs_per_tile`` programs per Dv tile); else the smallest (``floor``, or next_pow2(dv))."""
    cap = triton.next_power_of_2(dv)
    for block in (64, 32, 16):
        if block <= cap and programs_per_tile * triton.cdiv(dv, block) >= _PROGRAMS_PER_SM * sms:
            return block
    return max(floor, min(16, cap))


@functools.cache
def _decode_block_dv(b: int, hv: int, dv: int, sms: int) -> int:
    return _pick_block_dv(b * hv, dv, sms, 1)


@functools.cache
def _chunk_config(h: int, dk: int, dv: int, chunk: int, sms: int) -> tuple[int, int, int, int]:
    """(BLOCK_DK, the prepare kernel's whole-Dv block, the state/output kernels' Dv tile, num_warps of
    the prepare/output kernels): the sequential state kernel's parallelism is heads x Dv tiles."""
    block_dk = max(16, triton.next_power_of_2(dk))
    block_dv = max(16, triton.next_power_of_2(dv))
    return block_dk, block_dv, _pick_block_dv(h, dv, sms, 16), 8 if chunk * max(block_dk, block_dv) >= 8192 else 4


def _check_block_dv(fn: str, block_dv: int | None, minimum: int) -> None:
    if block_dv is not None and (block_dv < minimum or block_dv & (block_dv - 1)):
        raise ValueError(f"{fn}: block_dv={block_dv}: expected a power of two >= {minimum}")


def _dims(dims: tuple[tuple[str, int | None], ...]) -> str:
    return "[" + ", ".join(name if size is None else f"{name}={size}" for name, size in dims) + "]"


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _expect(fn: str, name: str, t: torch.Tensor, dims: tuple[tuple[str, int | None], ...],
            dtypes: tuple[torch.dtype, ...], layout: str = "") -> None:
    """Raise ValueError naming ``t`` unless its shape matches ``dims`` (None: any size), its dtype is
    one of ``dtypes`` and its layout is ``layout`` ("": any; "rows": last dim contiguous; "contiguous")."""
    shape_ok = t.dim() == len(dims) and all(size is None or s == size for s, (_, size) in zip(t.shape, dims))
    layout_ok = (not layout or t.numel() == 0 or (t.is_contiguous() if layout == "contiguous" else t.stride(-1) == 1))
    if not (shape_ok and t.dtype in dtypes and layout_ok):
        want = {"": "", "rows": ", last dim contiguous", "contiguous": ", contiguous"}[layout]
        raise ValueError(f"{fn}: {name} {tuple(t.shape)} {_dtype_name(t.dtype)} (strides {t.stride()}): expected "
                         f"{_dims(dims)} {'/'.join(_dtype_name(d) for d in dtypes)}{want}")


def _expect_device(fn: str, tensors: dict[str, torch.Tensor]) -> torch.device:
    device = next(iter(tensors.values())).device
    for name, t in tensors.items():
        if t.device != device or not (t.is_cuda or INTERPRET):
            raise ValueError(f"{fn}: {name} is on {t.device}: expected every operand on one CUDA device "
                             f"(CPU only under the Triton interpreter), the first on {device}")
    return device


def gdn_decode_step(mixed_qkv: torch.Tensor, a: torch.Tensor, b: torch.Tensor, conv_weight: torch.Tensor,
                    A_log: torch.Tensor, dt_bias: torch.Tensor, conv_states: torch.Tensor, rec_states: torch.Tensor,
                    slots: torch.Tensor, has_state: torch.Tensor, num_k_heads: int, num_v_heads: int,
                    head_k_dim: int, head_v_dim: int, *, out_slots: torch.Tensor | None = None,
                    block_dv: int | None = None) -> torch.Tensor:
    """Gated DeltaNet decode rows of Q tokens each (Q = 1 without ``out_slots``), from the pre-conv
    projection to the rule's output.

    ``mixed_qkv`` [B*Q, conv_dim] (in_proj_qkv's output, row r's tokens at r*Q..r*Q+Q-1; rows may be
    strided), ``a``/``b`` [B*Q, Hv] (in_proj_a / in_proj_b outputs), ``conv_weight`` [conv_dim, K],
    ``A_log``/``dt_bias`` [Hv]: bf16/fp16/fp32. ``conv_states`` [num_slots, conv_dim, K-1] and
    ``rec_states`` [num_slots, Hv, Dk, Dv]: float32, contiguous; row r starts from slot ``slots[r]``
    [B] (int64), from zero conv and recurrent state where ``has_state[r]`` [B] (int32 or bool) is 0.
    The state after each token is written to ``out_slots`` [B, Q] (int64; -1: not written; a verify
    row's tokens after its last real one), which may name the row's own slot only at its last written
    token; without ``out_slots`` the state after a row's one token replaces its slot's. Returns the
    rule's output [B*Q, Hv, Dv] float32 (before the gated norm). ``block_dv`` forces the recurrent
    kernel's Dv tile.
    """
    fn = "gdn_decode_step"
    _check_block_dv(fn, block_dv, 1)
    hk, hv, dk, dv = num_k_heads, num_v_heads, head_k_dim, head_v_dim
    if min(hk, hv, dk, dv) < 1 or hv % hk:
        raise ValueError(f"{fn}: num_k_heads={hk}, num_v_heads={hv}, head_k_dim={dk}, head_v_dim={dv}: expected "
                         "positive sizes, num_v_heads a multiple of num_k_heads")
    conv_dim = 2 * hk * dk + hv * dv
    _expect(fn, "mixed_qkv", mixed_qkv, (("B", None), ("conv_dim", conv_dim)), _FLOATS, "rows")
    _expect(fn, "conv_weight", conv_weight, (("conv_dim", conv_dim), ("K", None)), _FLOATS)
    rows, kernel = mixed_qkv.shape[0], conv_weight.shape[1]
    if kernel < 2:
        raise ValueError(f"{fn}: conv_weight {tuple(conv_weight.shape)}: expected a conv kernel K >= 2")
    _expect(fn, "a", a, (("B", rows), ("Hv", hv)), _FLOATS, "rows")
    _expect(fn, "b", b, (("B", rows), ("Hv", hv)), _FLOATS, "rows")
    _expect(fn, "A_log", A_log, (("Hv", hv),), _FLOATS, "contiguous")
    _expect(fn, "dt_bias", dt_bias, (("Hv", hv),), _FLOATS, "contiguous")
    _expect(fn, "conv_states", conv_states, (("num_slots", None), ("conv_dim", conv_dim),
                                             ("K-1", kernel - 1)), _F32, "contiguous")
    _expect(fn, "rec_states", rec_states, (("num_slots", conv_states.shape[0]), ("Hv", hv), ("Dk", dk), ("Dv", dv)),
            _F32, "contiguous")
    seqs, per_row = rows, 1
    if out_slots is not None:
        _expect(fn, "out_slots", out_slots, (("B", None), ("Q", None)), (torch.int64,), "contiguous")
        seqs, per_row = out_slots.shape
        if seqs * per_row != rows:
            raise ValueError(f"{fn}: out_slots {tuple(out_slots.shape)}: expected [B, Q] with B*Q = {rows}, the "
                             "rows of mixed_qkv")
    _expect(fn, "slots", slots, (("B", seqs),), (torch.int64,), "contiguous")
    _expect(fn, "has_state", has_state, (("B", seqs),), (torch.int32, torch.bool), "contiguous")
    device = _expect_device(fn, dict(mixed_qkv=mixed_qkv, a=a, b=b, conv_weight=conv_weight, A_log=A_log,
                                     dt_bias=dt_bias, conv_states=conv_states, rec_states=rec_states, slots=slots,
                                     has_state=has_state, **({} if out_slots is None else dict(out_slots=out_slots))))
    out = torch.empty((rows, hv, dv), dtype=torch.float32, device=device)
    if rows == 0:
        return out
    qkv = torch.empty((rows, conv_dim), dtype=torch.float32, device=device)
    out_slots = slots if out_slots is None else out_slots
    _decode_conv_kernel[(seqs, 2 * hk + hv)](
        mixed_qkv, conv_weight, conv_states, slots, out_slots, has_state, qkv,
        mixed_qkv.stride(0), conv_weight.stride(0), conv_weight.stride(1), dk ** -0.5,
        HK=hk, HV=hv, DK=dk, DV=dv, KERNEL=kernel, BLOCK_D=triton.next_power_of_2(max(dk, dv)), EPS=_L2_EPS,
        Q=per_row, num_warps=4)
    bdv = block_dv or _decode_block_dv(seqs, hv, dv, num_sms(device))
    _decode_recurrent_kernel[(seqs, hv, triton.cdiv(dv, bdv))](
        qkv, a, b, A_log, dt_bias, rec_states, slots, out_slots, has_state, out, a.stride(0), b.stride(0),
        HK=hk, HV=hv, DK=dk, DV=dv, BLOCK_DK=triton.next_power_of_2(dk), BLOCK_DV=bdv,
        THRESHOLD=_SOFTPLUS_THRESHOLD, Q=per_row, num_warps=4)
    return out


def chunk_gated_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                           state: torch.Tensor, chunk: int = 64, *,
                           block_dv: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`vtcore.layers.gated_delta.gated_delta_chunked` in three launches.

    ``q``/``k`` [T, H, Dk] (l2-normalised, q scaled), ``v`` [T, H, Dv], ``g``/``beta`` [T, H]: any
    strides, bf16/fp16/fp32, read as float32; ``state`` [H, Dk, Dv] float32 contiguous
    (not modified). ``chunk``: a power of two >= 16. Returns (out [T, H, Dv], new_state [H, Dk, Dv]),
    new float32 tensors. ``block_dv`` forces the Dv tile of the state and output kernels (>= 16).
    """
    fn = "chunk_gated_delta_rule"
    if chunk < 16 or chunk & (chunk - 1):
        raise ValueError(f"{fn}: chunk={chunk}: expected a power of two >= 16")
    _check_block_dv(fn, block_dv, 16)
    _expect(fn, "q", q, (("T", None), ("H", None), ("Dk", None)), _FLOATS)
    t, h, dk = q.shape
    _expect(fn, "k", k, (("T", t), ("H", h), ("Dk", dk)), _FLOATS)
    _expect(fn, "v", v, (("T", t), ("H", h), ("Dv", None)), _FLOATS)
    dv = v.shape[2]
    _expect(fn, "g", g, (("T", t), ("H", h)), _FLOATS)
    _expect(fn, "beta", beta, (("T", t), ("H", h)), _FLOATS)
    _expect(fn, "state", state, (("H", h), ("Dk", dk), ("Dv", dv)), _F32, "contiguous")
    device = _expect_device(fn, dict(q=q, k=k, v=v, g=g, beta=beta, state=state))
    out = torch.empty((t, h, dv), dtype=torch.float32, device=device)
    if t == 0 or h == 0:
        return out, state.clone()
    num_chunks = triton.cdiv(t, chunk)
    t_pad = num_chunks * chunk
    block_dk, prepare_dv, tile_dv, warps = _chunk_config(h, dk, dv, chunk, num_sms(device))
    bdv = block_dv or tile_dv
    u = torch.empty((h, t_pad, dv), dtype=torch.float32, device=device)  # u, then v_new
    w = torch.empty((h, t_pad, dk), dtype=torch.float32, device=device)
    cum = torch.empty((h, t_pad), dtype=torch.float32, device=device)
    chunk_states = torch.empty((h, num_chunks, dk, dv), dtype=torch.float32, device=device)
    new_state = torch.empty_like(state)
    _chunk_prepare_kernel[(num_chunks, h)](
        k, v, g, beta, u, w, cum, t, t_pad, *k.stride(), *v.stride(), *g.stride(), *beta.stride(),
        DK=dk, DV=dv, CHUNK=chunk, BLOCK_DK=block_dk, BLOCK_DV=prepare_dv,
        num_warps=warps)
    _chunk_state_kernel[(h, triton.cdiv(dv, bdv))](
        k, u, w, cum, state, chunk_states, new_state, t, t_pad, num_chunks, *k.stride(),
        DK=dk, DV=dv, CHUNK=chunk, BLOCK_DK=block_dk, BLOCK_DV=bdv, num_warps=4)
    _chunk_output_kernel[(num_chunks, h, triton.cdiv(dv, bdv))](
        q, k, u, cum, chunk_states, out, t, t_pad, num_chunks, *q.stride(), *k.stride(),
        H=h, DK=dk, DV=dv, CHUNK=chunk, BLOCK_DK=block_dk, BLOCK_DV=bdv, num_warps=warps)
    return out, new_state
