"""Skinny GEMM for decode: ``y = x @ W.T (+ bias)`` with ``x`` [M, K], M <= 16, ``W`` [N, K].

Weight-streaming and memory-bound: every weight byte is read once, by one program. A program
owns ``BLOCK_N`` weight rows and one K range, and per step loads a ``[BLOCK_N, BLOCK_K]`` weight
tile (contiguous along K: 16-byte vector loads) plus x's matching ``[M, BLOCK_K]`` chunk:

* ``M == 1``: the tile times the x chunk, elementwise, added into a float32 ``[BLOCK_N, BLOCK_K]``
  accumulator that is summed over K once, at the end (no cross-thread reduction per step). Triton
  only software-pipelines loads that feed a dot, so the loop double-buffers in registers by hand:
  the next tile's loads are issued before the current tile's FMAs (checked in the sm_90 PTX);
* ``M > 1``: ``tl.dot(W_tile, x_chunk.T)`` into a float32 ``[BLOCK_N, 16]`` accumulator (x's rows
  padded to 16 with zeros; the weight is the dot's left operand, so BLOCK_N >= 16); ``num_stages``
  pipelines it through shared memory (cp.async).

Split-K: when ``cdiv(N, BLOCK_N)`` is under 2x the SM count (the narrow-N / long-K shapes, e.g.
o_proj and down_proj), the K tiles are also split over a second grid axis; each program writes its
float32 partial to a ``[split, M, N]`` workspace and a second small kernel sums the partials in
split order 0, 1, ... (then bias, then one rounding). No atomics anywhere: results are
deterministic (the same bits run to run; they can differ between configs, i.e. between M == 1 and
M > 1 or between split and unsplit, in the float32 summation order only).

Launch configs come from host ints only (M, N, K, dtype size, SM count), cached with
``functools.cache``; no autotuning, no sync, no data-dependent grid, so calls can be captured in a
CUDA graph. Allocations: the output, plus the float32 workspace on the split path (a caching-
allocator ``torch.empty`` like the decode attention's scratch: graph-safe, from the graph's pool
under capture).

Heuristic (``_config``; untuned on hardware, every field can be forced by keyword): aim for
>= 3 programs per SM with ~8 KB weight tiles; M == 1 takes BLOCK_N in {16, 8, 4} (largest that
gives >= 3x SMs tiles), ``BLOCK_K = 8 KB / (BLOCK_N * itemsize)`` (halved until it divides K, so
the hot loop has no mask), 4 warps, 3 stages; M > 1 takes BLOCK_N = 16 (M <= 4) or 32, same
tile bytes. Split when tiles < 2x SMs: the smallest split reaching 3x SMs programs, moved up to
a divisor of the K-tile count when one is within 2x (balanced splits), capped so the partials'
traffic (8 * split * M * N bytes) stays under a quarter of the weight bytes.
"""
from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl
from torch.nn import functional as F

from vtcore.kernels.rmsnorm import INTERPRET, _cast

__all__ = ["gemv", "supports", "gemv_ref"]

_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
_MAX_M = 16
_TILE_BYTES = 8192  # weight bytes per program per K step
_PROGRAMS_PER_SM = 3  # programs the heuristic aims for
_SPLIT_BELOW_PER_SM = 2  # split K when the N tiles are fewer than this many per SM
_REDUCE_BLOCK = 512
_INTERPRET_SMS = 132  # the H200's, so the interpreter runs the same heuristic


def gemv_ref(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear`` semantics (the torch reference; on bf16 CPU it may differ by 1 ulp from a
    float32-accumulated result, which ``(x.float() @ w.float().T).to(dtype)`` gives)."""
    return F.linear(x, weight, bias)


def supports(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> bool:
    """Whether :func:`gemv` handles these operands (else use ``F.linear``)."""
    if not (x.is_cuda or INTERPRET) or x.device != weight.device:
        return False
    if x.dim() != 2 or weight.dim() != 2 or x.dtype not in _DTYPES or weight.dtype != x.dtype:
        return False
    m, k = x.shape
    if m > _MAX_M or weight.shape[1] != k or k == 0 or k % 8 or not weight.is_contiguous() or (k > 1 and x.stride(1) != 1):
        return False
    return bias is None or (bias.dtype == x.dtype and bias.shape == (weight.shape[0],) and bias.is_contiguous()
                            and bias.device == x.device)


@triton.jit
def _load_row_tile(w_ptrs, x_ptr, offs_k, k0, K: tl.constexpr, EVEN_K: tl.constexpr):
    """The [BLOCK_N, BLOCK_K] weight tile at column ``k0`` and x's (single row's) matching chunk."""
    if EVEN_K:
        w = tl.load(w_ptrs + k0)
        xv = tl.load(x_ptr + k0 + offs_k)
    else:
        k_mask = k0 + offs_k < K
        w = tl.load(w_ptrs + k0, mask=k_mask[None, :], other=0.0)
        xv = tl.load(x_ptr + k0 + offs_k, mask=k_mask, other=0.0)
    return w, xv


@triton.jit
def _gemv_kernel(
    x_ptr, w_ptr, b_ptr, out_ptr, M, stride_xm,
    N: tl.constexpr, K: tl.constexpr, K_SPLIT: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    EVEN_N: tl.constexpr, EVEN_K: tl.constexpr, HAS_BIAS: tl.constexpr, SPLIT_OUT: tl.constexpr,
    DOT_PRECISION: tl.constexpr, INTERPRET: tl.constexpr,
):
    """Program (n tile, k split): ``BLOCK_N`` output columns over K range ``[pid_k * K_SPLIT, +K_SPLIT)``.

    ``SPLIT_OUT``: writes the float32 partial to ``out_ptr`` = workspace ``[split, M, N]``; else adds
    the bias and writes the rounded result to ``out_ptr`` = output ``[M, N]`` (contiguous).
    """
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    n_mask = offs_n < N
    # Clamp rows past N onto row N - 1: every weight load stays in bounds without a mask (the
    # columns they produce are never stored).
    rows = offs_n if EVEN_N else tl.minimum(offs_n, N - 1)
    w_ptrs = w_ptr + rows.to(tl.int64)[:, None] * K + offs_k[None, :]
    k_start = pid_k * K_SPLIT
    k_end = tl.minimum(k_start + K_SPLIT, K)
    if BLOCK_M == 1:
        # Register double buffering: tile i + 1 is requested before tile i is multiplied, so two
        # tiles per program are in flight (Triton's pipeliner stages only loads that feed a dot).
        # Every program has at least one tile (the host never makes an empty split).
        acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
        w, xv = _load_row_tile(w_ptrs, x_ptr, offs_k, k_start, K, EVEN_K)
        for k0 in range(k_start + BLOCK_K, k_end, BLOCK_K):
            w_next, x_next = _load_row_tile(w_ptrs, x_ptr, offs_k, k0, K, EVEN_K)
            acc += w.to(tl.float32) * xv.to(tl.float32)[None, :]
            w, xv = w_next, x_next
        acc += w.to(tl.float32) * xv.to(tl.float32)[None, :]
        y = tl.sum(acc, axis=1)  # [BLOCK_N]
        if SPLIT_OUT:
            tl.store(out_ptr + pid_k * (M * N) + offs_n, y, mask=n_mask)
        else:
            if HAS_BIAS:
                y += tl.load(b_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)
            tl.store(out_ptr + offs_n, _cast(y, out_ptr.dtype.element_ty, INTERPRET), mask=n_mask)
    else:
        offs_m = tl.arange(0, BLOCK_M)
        m_mask = offs_m < M
        x_ptrs = x_ptr + offs_m[None, :] * stride_xm + offs_k[:, None]  # x chunk transposed: [BLOCK_K, BLOCK_M]
        acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
        for k0 in range(k_start, k_end, BLOCK_K):
            if EVEN_K:
                w = tl.load(w_ptrs + k0)
                xt = tl.load(x_ptrs + k0, mask=m_mask[None, :], other=0.0)
            else:
                k_mask = k0 + offs_k < K
                w = tl.load(w_ptrs + k0, mask=k_mask[None, :], other=0.0)
                xt = tl.load(x_ptrs + k0, mask=k_mask[:, None] & m_mask[None, :], other=0.0)
            acc = tl.dot(w, xt, acc, input_precision=DOT_PRECISION)
        y = tl.trans(acc)  # [BLOCK_M, BLOCK_N]
        mask = m_mask[:, None] & n_mask[None, :]
        dst = offs_m[:, None] * N + offs_n[None, :]
        if SPLIT_OUT:
            tl.store(out_ptr + pid_k * (M * N) + dst, y, mask=mask)
        else:
            if HAS_BIAS:
                y += tl.load(b_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
            tl.store(out_ptr + dst, _cast(y, out_ptr.dtype.element_ty, INTERPRET), mask=mask)


@triton.jit
def _split_reduce_kernel(
    ws_ptr, b_ptr, out_ptr, M,
    N: tl.constexpr, SPLIT: tl.constexpr, BLOCK: tl.constexpr, HAS_BIAS: tl.constexpr, INTERPRET: tl.constexpr,
):
    """``out = round(sum_{s = 0, 1, ...} ws[s] + bias)`` over the flattened ``[M, N]``, split order fixed."""
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    size = M * N
    mask = offs < size
    acc = tl.load(ws_ptr + offs, mask=mask, other=0.0)
    for s in tl.static_range(1, SPLIT):
        acc += tl.load(ws_ptr + s * size + offs, mask=mask, other=0.0)
    if HAS_BIAS:
        acc += tl.load(b_ptr + offs % N, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + offs, _cast(acc, out_ptr.dtype.element_ty, INTERPRET), mask=mask)


@functools.cache
def _num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return _INTERPRET_SMS
    return torch.cuda.get_device_properties(device).multi_processor_count


def _pick_block_k(k: int, target: int, floor: int) -> int:
    """The largest power of two <= ``target`` (and <= next_pow2(k)) dividing ``k``, not below
    ``floor``; if none does, ``min(target, next_pow2(k))`` (the loop then masks K)."""
    bk = max(16, min(target, triton.next_power_of_2(k)))
    b = bk
    while b > floor and k % b:
        b //= 2
    return b if k % b == 0 else bk


@functools.cache
def _config(m: int, n: int, k: int, itemsize: int, sms: int, block_n: int | None, block_k: int | None,
            split_k: int | None, num_warps: int | None, num_stages: int | None) -> tuple[int, ...]:
    """(BLOCK_M, BLOCK_N, BLOCK_K, split, K_SPLIT, num_warps, num_stages) for one shape; forced values win."""
    target = _PROGRAMS_PER_SM * sms
    if m == 1:
        block_m = 1
        bn = block_n or next((b for b in (16, 8) if triton.cdiv(n, b) >= target), 4)
    else:
        block_m = 16
        bn = block_n or (16 if m <= 4 else 32)
    floor = 32 * (16 // itemsize)  # one warp of 16-byte loads across K
    bk = block_k or _pick_block_k(k, max(16, _TILE_BYTES // (bn * itemsize)), floor)
    k_tiles = triton.cdiv(k, bk)
    n_tiles = triton.cdiv(n, bn)
    if split_k is not None:
        split = max(1, min(split_k, k_tiles))
    elif n_tiles < _SPLIT_BELOW_PER_SM * sms and k_tiles > 1:
        # Capped so the float32 partials (written and read back: 8 * split * M * N bytes) stay
        # under a quarter of the weight bytes.
        split = max(1, min(k_tiles, triton.cdiv(target, n_tiles), k * itemsize // (32 * m)))
        split = next((s for s in range(split, min(k_tiles, 2 * split) + 1) if k_tiles % s == 0), split)
    else:
        split = 1
    per_split = triton.cdiv(k_tiles, split)
    split = triton.cdiv(k_tiles, per_split)  # no empty splits
    return block_m, bn, bk, split, per_split * bk, num_warps or 4, num_stages or 3


def gemv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *,
         block_n: int | None = None, block_k: int | None = None, split_k: int | None = None,
         num_warps: int | None = None, num_stages: int | None = None) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` for ``x`` [M, K] (M <= 16; rows may be strided, the last dim
    contiguous), ``weight`` [N, K] contiguous, ``bias`` [N]; all one dtype (bf16/fp16/fp32), see
    :func:`supports`. Returns a new contiguous [M, N] tensor in x's dtype: float32 accumulation,
    bias added in float32, one rounding.

    The keywords force parts of the launch config (powers of two; ``block_n`` >= 16 when M > 1;
    ``split_k`` is capped at the number of K tiles); by default :func:`_config` picks them.
    """
    if x.dim() != 2 or weight.dim() != 2 or x.shape[1] != weight.shape[1] or x.shape[0] > _MAX_M:
        raise ValueError(f"gemv: x {tuple(x.shape)}, weight {tuple(weight.shape)}: expected x [M<={_MAX_M}, K] "
                         "and weight [N, K] (see supports() for the dtype and layout rules)")
    m, k = x.shape
    n = weight.shape[0]
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0 or n == 0:
        return out
    block_m, bn, bk, split, k_split, warps, stages = _config(
        m, n, k, x.element_size(), _num_sms(x.device), block_n, block_k, split_k, num_warps, num_stages)
    dot_precision = "ieee" if x.dtype == torch.float32 else "tf32"  # tf32 is moot for 16-bit inputs
    b = weight if bias is None else bias
    grid = (triton.cdiv(n, bn), split)
    meta = dict(N=n, K=k, K_SPLIT=k_split, BLOCK_M=block_m, BLOCK_N=bn, BLOCK_K=bk, EVEN_N=n % bn == 0,
                EVEN_K=k % bk == 0, HAS_BIAS=bias is not None, DOT_PRECISION=dot_precision, INTERPRET=INTERPRET,
                num_warps=warps, num_stages=stages, enable_fp_fusion=True)  # pinned: Triton 3.10 flips the default
    if split == 1:
        _gemv_kernel[grid](x, weight, b, out, m, x.stride(0), SPLIT_OUT=False, **meta)
        return out
    ws = torch.empty((split, m, n), dtype=torch.float32, device=x.device)
    _gemv_kernel[grid](x, weight, b, ws, m, x.stride(0), SPLIT_OUT=True, **meta)
    _split_reduce_kernel[(triton.cdiv(m * n, _REDUCE_BLOCK),)](
        ws, b, out, m, N=n, SPLIT=split, BLOCK=_REDUCE_BLOCK, HAS_BIAS=bias is not None, INTERPRET=INTERPRET,
        num_warps=4, enable_fp_fusion=True)
    return out
