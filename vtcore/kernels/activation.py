"""SwiGLU ``silu(gate) * up`` on a fused [gate | up] projection, one launch, grid (tokens, I / BLOCK).

Rounds as torch does in ``x.dtype``: ``silu`` in float32 as ``g / (1 + exp(-g))`` (IEEE division,
``tl.div_rn``), rounded, then the product with ``up`` rounded. On CUDA ``exp`` is libdevice's
``expf``, what torch's CUDA silu calls (``tl.exp`` would be a bare ``ex2.approx``), and FMA
contraction is left on, as nvcc's default ``--fmad=true`` builds torch's kernel: both then fuse
``expf``'s last scaling into ``1 + e`` and should round the same float32 values (expected, not yet
verified on a GPU). In the interpreter ``exp`` is numpy's, which may differ from torch's CPU (Sleef)
``exp`` in the last float32 bit.
"""
from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl
from torch.nn import functional as F
from triton.language.extra import libdevice

from vtcore.kernels.rmsnorm import INTERPRET, _cast

__all__ = ["silu_and_mul", "silu_and_mul_ref"]


@triton.jit
def exp(x, INTERPRET: tl.constexpr):
    """libdevice's ``expf`` on CUDA (what torch's CUDA kernels call; ``tl.exp`` is a bare
    ``ex2.approx``), numpy's in the interpreter."""
    if INTERPRET:
        y = tl.exp(x)
    else:
        y = libdevice.exp(x)
    return y


@triton.jit
def silu_mul(g, u, DT: tl.constexpr, INTERPRET: tl.constexpr):
    """``silu(g) * u`` of float32 ``g``, ``u`` holding ``DT`` values, rounded to ``DT`` as torch
    rounds each op (also the GEMV's SwiGLU prologue and the fused MoE's, so all paths round alike)."""
    s = _cast(tl.div_rn(g, 1.0 + exp(-g, INTERPRET)), DT, INTERPRET).to(tl.float32)
    return _cast(s * u, DT, INTERPRET)


@triton.jit
def _silu_and_mul_kernel(x_ptr, out_ptr, stride_x, I: tl.constexpr, BLOCK: tl.constexpr, INTERPRET: tl.constexpr):
    DT: tl.constexpr = x_ptr.dtype.element_ty
    row = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < I
    g = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(x_ptr + row * stride_x + I + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * I + cols, silu_mul(g, u, DT, INTERPRET), mask=mask)


@functools.cache
def _config(i: int) -> tuple[int, int, int]:
    """(BLOCK, num_warps, programs a row): up to 1024 outputs a program, 8 a thread (16-byte bf16 vectors)."""
    block = min(1024, triton.next_power_of_2(i))
    return block, max(1, block // 256), triton.cdiv(i, block)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """``silu(x[:, :I]) * x[:, I:]`` for ``x`` [tokens, 2 * I] (rows may be strided, the last dim must
    be contiguous) into a new contiguous [tokens, I] tensor of ``x.dtype``."""
    t, i = x.shape[0], x.shape[1] // 2
    out = torch.empty((t, i), dtype=x.dtype, device=x.device)
    block, num_warps, programs = _config(i)
    _silu_and_mul_kernel[(t, programs)](x, out, x.stride(0), I=i, BLOCK=block, INTERPRET=INTERPRET,
                                        num_warps=num_warps, enable_fp_fusion=True)
    return out


def silu_and_mul_ref(x: torch.Tensor) -> torch.Tensor:
    """Torch reference: :func:`vtcore.layers.activation.silu_and_mul`'s torch path, restated because
    that function dispatches to this kernel on CUDA (the tests check the two agree on CPU)."""
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up
