"""RMSNorm, optionally with the residual add fused in: one program per row, one launch per call.

:func:`rms_norm_ref` and :func:`fused_add_rms_norm_ref` are the torch references (HF's RMSNorm, the
CPU path of :class:`vtcore.layers.norm.RMSNorm`). The kernels round as they do step by step: float32
statistics, ``h`` rounded to the activation dtype before a (non-zero-centred) weight multiplies it,
each product or sum of two bf16/fp16 values formed in float32 and rounded once, as torch does. What
differs:

* the order of the float32 sum of squares (a tree here), so ``rsqrt``'s argument can differ from
  torch's in the last bit; it is bit-identical when the sum is exact (e.g. inputs on a coarse grid);
* the mean is ``sum * float32(1 / N)``, as torch's CUDA ``mean`` computes it (its CPU ``mean``
  divides: the two agree for power-of-two N);
* ``tl.rsqrt`` is ``rsqrt.approx.ftz.f32`` on CUDA (torch's CUDA ``rsqrt`` is ``rsqrt.approx.f32``:
  the same for normal inputs) and ``1 / np.sqrt`` in the interpreter (bit-equal to torch's CPU
  ``rsqrt``).

FMA contraction is switched off at launch (``enable_fp_fusion=False``) so that no product is fused
into a following add, which would skip a rounding torch performs. The elementwise tail and the
rounding are :mod:`vtcore.kernels.helpers`' ``normalize`` and ``cast``, shared with the other kernels
that fuse a norm.
"""
from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from vtcore.kernels.helpers import INTERPRET, cast, normalize
from vtcore.kernels.pdl import pdl_launch, wait_prior

__all__ = ["rms_norm", "fused_add_rms_norm", "rms_norm_ref", "fused_add_rms_norm_ref"]


@triton.jit
def _rms_norm_kernel(
    x_ptr, r_ptr, w_ptr, out_ptr, r_out_ptr,
    stride_x, stride_r, eps,
    N: tl.constexpr,
    BLOCK: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr,
    ZERO_CENTERED: tl.constexpr,
    INTERPRET: tl.constexpr,
    PDL: tl.constexpr,
):
    wait_prior(PDL)
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < N
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:
        r = tl.load(r_ptr + row * stride_r + cols, mask=mask, other=0.0).to(tl.float32)
        s = cast(r + x, r_out_ptr.dtype.element_ty, INTERPRET)
        tl.store(r_out_ptr + row * N + cols, s, mask=mask)
        x = s.to(tl.float32)
    rstd = tl.rsqrt(tl.sum(x * x, axis=0) * (1.0 / N) + eps)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    y = normalize(x, rstd, w, ZERO_CENTERED, x_ptr.dtype.element_ty, INTERPRET)
    tl.store(out_ptr + row * N + cols, cast(y, out_ptr.dtype.element_ty, INTERPRET), mask=mask)


@functools.cache
def _config(n: int) -> tuple[int, int]:
    """(BLOCK, num_warps) for a row of ``n``: the whole row in registers, <= 16 values a thread."""
    block = triton.next_power_of_2(n)
    return block, min(8, max(1, block // 256))


def _launch(x: torch.Tensor, residual: torch.Tensor | None, new_residual: torch.Tensor | None,
            weight: torch.Tensor, eps: float, zero_centered: bool) -> torch.Tensor:
    t, n = x.shape
    if weight.shape != (n,) or (residual is not None and residual.shape != x.shape) or x.stride(-1) != 1:
        raise ValueError(f"rms_norm: x {tuple(x.shape)} (last-dim stride {x.stride(-1)}), weight {tuple(weight.shape)}"
                         f"{'' if residual is None else f', residual {tuple(residual.shape)}'}: expected weight "
                         f"[{n}], a residual shaped like x, x's last dim contiguous")
    # weight * h.to(x.dtype) promotes (a float32 weight gives a float32 output); zero-centred casts back.
    dtype = x.dtype if zero_centered or weight.dtype == x.dtype else torch.promote_types(x.dtype, weight.dtype)
    out = torch.empty((t, n), dtype=dtype, device=x.device)
    block, num_warps = _config(n)
    _rms_norm_kernel[(t,)](
        x, x if residual is None else residual, weight, out, out if new_residual is None else new_residual,
        x.stride(0), 0 if residual is None else residual.stride(0), eps,
        N=n, BLOCK=block, HAS_RESIDUAL=residual is not None, ZERO_CENTERED=zero_centered, INTERPRET=INTERPRET,
        num_warps=num_warps, enable_fp_fusion=False, **pdl_launch(x.device),
    )
    return out


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, zero_centered: bool = False) -> torch.Tensor:
    """:func:`rms_norm_ref` of ``x`` [tokens, hidden] (rows may be strided, the last
    dim must be contiguous) into a new contiguous tensor."""
    return _launch(x, None, None, weight, eps, zero_centered)


def fused_add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float,
                       zero_centered: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """``(rms_norm(residual + x), residual + x)``, both new contiguous tensors; the sum is rounded to
    ``x.dtype`` (``residual`` must have it) before the norm reads it, as ``RMSNorm.forward`` does.

    Out of place on purpose: writing the sum into ``residual`` would save no memory traffic (the same
    bytes are written either way), only an allocator call that a CUDA graph replay skips anyway, and
    it would make the kernel mutate an input the caller may still hold (e.g. the embedding output).
    """
    new_residual = torch.empty((x.shape[0], x.shape[1]), dtype=x.dtype, device=x.device)
    return _launch(x, residual, new_residual, weight, eps, zero_centered), new_residual


def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float, zero_centered: bool = False) -> torch.Tensor:
    """HF's RMSNorm over the last dim: ``h = x.float() * rsqrt(mean(h^2) + eps)``, then
    ``weight * h.to(x.dtype)`` (the cast first: a bf16 weight gives a bf16 product), or zero-centred
    ``(h * (1 + weight.float())).to(x.dtype)``. Pure torch, any shape: the reference of
    :func:`rms_norm` and of the norms fused into other kernels (``rope``, ``gemv``)."""
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    if zero_centered:
        return (h * (1.0 + weight.float())).to(x.dtype)
    return weight * h.to(x.dtype)


def fused_add_rms_norm_ref(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float,
                           zero_centered: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Torch reference of :func:`fused_add_rms_norm` (``RMSNorm.forward`` with a residual)."""
    new_residual = residual + x
    return rms_norm_ref(new_residual, weight, eps, zero_centered), new_residual
