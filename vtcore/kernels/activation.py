"""SwiGLU ``silu(gate) * up`` on a fused [gate | up] projection, one launch, grid (tokens, I / BLOCK).

:func:`silu_and_mul_ref` is the torch reference (the CPU path of
:func:`vtcore.layers.activation.silu_and_mul`). The kernel rounds as torch does in ``x.dtype``
(:func:`vtcore.kernels.helpers.silu_mul`): ``silu`` in float32 as ``g / (1 + exp(-g))`` (IEEE
division, ``tl.div_rn``), rounded, then the product with ``up`` rounded. On CUDA ``exp`` is
libdevice's ``expf``, what torch's CUDA silu calls (``tl.exp`` would be a bare ``ex2.approx``), and
FMA contraction is left on, as nvcc's default ``--fmad=true`` builds torch's kernel: both then fuse
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

from vtcore.kernels.helpers import INTERPRET, silu_mul

__all__ = ["silu_and_mul", "silu_and_mul_ref"]


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
    """Torch reference of :func:`silu_and_mul`: ``F.silu(gate) * up`` in ``x.dtype``, any leading shape."""
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up
