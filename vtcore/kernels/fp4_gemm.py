"""W4A16 GEMM for FP4 (NVFP4 / MXFP4) packed weights: ``y = x @ W.T (+ bias)``.

Semantics are those of :func:`vtcore.kernels.fp4.fp4_linear_reference`; the weight is never
materialized: each program loads packed uint8 bytes and the raw scale bytes of its tile and decodes
them in registers (:mod:`vtcore.kernels.helpers`' ``e2m1_to_f32``, ``e4m3_to_f32``, ``e8m0_to_f32``:
integer arithmetic and a bitcast to float32, bit-equal to the reference's decode). The NVFP4 group
scale is ``div_rn(e4m3, global[row])`` (IEEE division, the reference's op order), then ``w = code *
scale`` in float32: for float32 ``x`` the decoded weights equal the reference's bit for bit and only
the summation order differs. For bf16/fp16 ``x`` the weight tile is rounded to ``x``'s dtype (for
bf16 that is exactly compressed-tensors' bf16 decompressed weight) and fed to ``tl.dot`` with float32
accumulation.

Columns are split by parity rather than interleaved: the low nibbles of a ``[BLOCK_K/2, BLOCK_N]``
byte tile multiply ``x``'s even columns and the high nibbles the odd ones (two ``tl.dot`` per step).

Decode sizes take :mod:`vtcore.kernels.gemv` instead (one row), summing group-factored with no weight
rounded (:func:`vtcore.kernels.helpers.fp4_step`).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from vtcore.kernels.helpers import e2m1_to_f32, e4m3_to_f32, e8m0_to_f32

__all__ = ["fp4_matmul"]


@triton.jit(do_not_specialize=["M"])
def _fp4_matmul_kernel(
    x_ptr, w_ptr, s_ptr, g_ptr, b_ptr, y_ptr,
    M, N, K,
    stride_xm, stride_xk,
    stride_wn, stride_wk,
    stride_sn, stride_sg,
    stride_ym, stride_yn,
    GROUP: tl.constexpr,
    SCALE_E8M0: tl.constexpr,
    HAS_GLOBAL: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    FP32_DOT: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    HALF_K: tl.constexpr = BLOCK_K // 2
    GROUPS: tl.constexpr = BLOCK_K // GROUP
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_p = tl.arange(0, HALF_K)  # packed (byte) column within the tile
    offs_g = tl.arange(0, GROUPS)
    m_mask = offs_m < M
    n_mask = offs_n < N
    k_half = K // 2
    n_groups = K // GROUP

    if HAS_GLOBAL:
        gs = tl.load(g_ptr + offs_n, mask=n_mask, other=1.0)

    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        p = k0 // 2 + offs_p
        p_mask = p < k_half
        # packed weight bytes, [HALF_K, BLOCK_N] (K-major for the dot)
        wb = tl.load(
            w_ptr + offs_n[None, :] * stride_wn + p[:, None] * stride_wk,
            mask=p_mask[:, None] & n_mask[None, :], other=0,
        ).to(tl.int32)
        w_lo = e2m1_to_f32(wb & 0xF)
        w_hi = e2m1_to_f32((wb >> 4) & 0xF)

        # raw scale bytes of the tile's groups, [GROUPS, BLOCK_N]
        g = k0 // GROUP + offs_g
        sb = tl.load(
            s_ptr + offs_n[None, :] * stride_sn + g[:, None] * stride_sg,
            mask=(g < n_groups)[:, None] & n_mask[None, :], other=0,
        ).to(tl.int32)
        if SCALE_E8M0:
            scale = e8m0_to_f32(sb)
        else:
            scale = e4m3_to_f32(sb)
            if HAS_GLOBAL:
                scale = tl.div_rn(scale, gs[None, :])
        w_lo = tl.reshape(tl.reshape(w_lo, (GROUPS, GROUP // 2, BLOCK_N)) * scale[:, None, :], (HALF_K, BLOCK_N))
        w_hi = tl.reshape(tl.reshape(w_hi, (GROUPS, GROUP // 2, BLOCK_N)) * scale[:, None, :], (HALF_K, BLOCK_N))

        # x's even and odd columns, [BLOCK_M, HALF_K] each
        x_off = x_ptr + offs_m[:, None] * stride_xm + (2 * p)[None, :] * stride_xk
        x_mask = m_mask[:, None] & p_mask[None, :]
        x_even = tl.load(x_off, mask=x_mask, other=0.0)
        x_odd = tl.load(x_off + stride_xk, mask=x_mask, other=0.0)
        if FP32_DOT:
            acc = tl.dot(x_even.to(tl.float32), w_lo, acc, input_precision="ieee")
            acc = tl.dot(x_odd.to(tl.float32), w_hi, acc, input_precision="ieee")
        else:
            acc = tl.dot(x_even, w_lo.to(x_even.dtype), acc)
            acc = tl.dot(x_odd, w_hi.to(x_odd.dtype), acc)

    if HAS_BIAS:
        acc += tl.load(b_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
    y = y_ptr + offs_m[:, None] * stride_ym + offs_n[None, :] * stride_yn
    tl.store(y, acc.to(y_ptr.dtype.element_ty), mask=m_mask[:, None] & n_mask[None, :])


def _default_blocks(m: int) -> tuple[int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_K) by M, from a sweep (docs/BENCHMARKS.md, issue 6): M <= 16: (16, 32,
    256), more programs over N and longer K steps; otherwise (min(64, next_pow2(M)) >= 32, 64, 128).
    """
    if m <= 16:
        return 16, 32, 256
    return min(64, triton.next_power_of_2(m)), 64, 128


def fp4_matmul(
    x: torch.Tensor,
    packed: torch.Tensor,
    weight_scale: torch.Tensor,
    scale_kind: str,
    row_global_scale: torch.Tensor | None,
    group_size: int,
    bias: torch.Tensor | None = None,
    *,
    block_m: int | None = None,
    block_n: int | None = None,
    block_k: int | None = None,
    num_warps: int = 4,
    num_stages: int = 3,
) -> torch.Tensor:
    """``x [..., K] @ W.T (+ bias) -> [..., N]`` in ``x.dtype``, W decoded from FP4 in registers.

    ``packed``: uint8 ``[N, K // 2]``; ``weight_scale``: raw scale bytes ``[N, K // group_size]``
    (uint8; a float8_e4m3fn tensor is viewed as its bytes); ``scale_kind``: ``"e4m3"`` (NVFP4) or
    ``"e8m0"`` (MXFP4); ``row_global_scale``: float32 ``[N]`` (or one value) that NVFP4 group scales
    are divided by, or None. Block sizes left None come from ``_default_blocks(M)``: (16, 32, 256)
    for M <= 16, else (min(64, next_pow2(M)), 64, 128); ``block_k`` must be a power of two multiple
    of ``group_size`` (and >= 32, ``block_m`` >= 16 on GPU, for ``tl.dot``).
    """
    if scale_kind not in ("e4m3", "e8m0"):
        raise ValueError(f"scale_kind must be 'e4m3' or 'e8m0', got {scale_kind!r}")
    if packed.dtype != torch.uint8:
        raise TypeError(f"packed FP4 weights must be uint8, got {packed.dtype}")
    if weight_scale.dtype in (torch.float8_e4m3fn, torch.int8):
        weight_scale = weight_scale.view(torch.uint8)
    if weight_scale.dtype != torch.uint8:
        raise TypeError(f"weight_scale must be raw uint8 bytes, got {weight_scale.dtype}")
    n, k = packed.shape[0], packed.shape[1] * 2
    if x.shape[-1] != k:
        raise ValueError(f"x has K={x.shape[-1]}, packed weight K={k}")
    if k % group_size != 0 or group_size % 2 != 0:
        raise ValueError(f"K={k} must be a multiple of an even group_size={group_size}")
    if tuple(weight_scale.shape) != (n, k // group_size):
        raise ValueError(f"weight_scale {tuple(weight_scale.shape)} != {(n, k // group_size)}")
    if scale_kind == "e8m0" and row_global_scale is not None:
        raise ValueError("MXFP4 (e8m0 scales) has no global scale")

    lead = x.shape[:-1]
    x2 = x.reshape(-1, k)
    m = x2.shape[0]
    dm, dn, dk = _default_blocks(m)
    bm, block_n, block_k = block_m or dm, block_n or dn, block_k or dk
    if block_k % group_size != 0 or block_k & (block_k - 1):
        raise ValueError(f"block_k={block_k} must be a power of two multiple of group_size={group_size}")
    y = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0 or n == 0:
        return y.reshape(*lead, n)

    has_global = row_global_scale is not None
    if has_global:
        g = row_global_scale.to(device=x.device, dtype=torch.float32).reshape(-1)
        if g.numel() == 1:
            g = g.expand(n)
        if g.numel() != n:
            raise ValueError(f"row_global_scale has {g.numel()} values, N={n}")
        g = g.contiguous()
    else:
        g = packed  # unused pointer
    has_bias = bias is not None
    b = bias.contiguous() if has_bias else packed  # unused pointer

    grid = (triton.cdiv(m, bm), triton.cdiv(n, block_n))
    _fp4_matmul_kernel[grid](
        x2, packed, weight_scale, g, b, y,
        m, n, k,
        x2.stride(0), x2.stride(1),
        packed.stride(0), packed.stride(1),
        weight_scale.stride(0), weight_scale.stride(1),
        y.stride(0), y.stride(1),
        GROUP=group_size,
        SCALE_E8M0=scale_kind == "e8m0",
        HAS_GLOBAL=has_global,
        HAS_BIAS=has_bias,
        FP32_DOT=x.dtype == torch.float32,
        BLOCK_M=bm,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        num_warps=num_warps,
        num_stages=num_stages,
    )
    return y.reshape(*lead, n)
