"""Gated RMSNorm of Gated DeltaNet's output, ``rms(x) * w * silu(z)``, one program per row.

Rounds as :class:`vtcore.layers.gated_deltanet.GatedRMSNorm` does on ``x.to(dtype)``: the float32
input rounded to the activation dtype first, float32 statistics, the normalised row rounded, the
product with the weight rounded, then times ``silu(z)`` in float32 (libdevice ``expf`` on CUDA,
IEEE division) and one last rounding. The caveats of :mod:`vtcore.kernels.rmsnorm` apply (the sum
of squares is a tree; the mean multiplies by ``1 / D``). One launch instead of torch's dozen.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from vtcore.kernels.helpers import INTERPRET, cast, exp, normalize

__all__ = ["gated_rms_norm"]


@triton.jit
def _gated_rms_norm_kernel(x_ptr, z_ptr, w_ptr, out_ptr, stride_x, stride_zt, stride_zh, eps, HEADS: tl.constexpr,
                           D: tl.constexpr, BLOCK: tl.constexpr, INTERPRET: tl.constexpr):
    DT: tl.constexpr = out_ptr.dtype.element_ty
    row = tl.program_id(0)
    z_ptr += (row // HEADS) * stride_zt + (row % HEADS) * stride_zh
    cols = tl.arange(0, BLOCK)
    mask = cols < D
    h = cast(tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32), DT, INTERPRET)
    h = h.to(tl.float32)
    rstd = tl.rsqrt(tl.sum(h * h, axis=0) * (1.0 / D) + eps)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    n = cast(normalize(h, rstd, w, False, DT, INTERPRET), DT, INTERPRET).to(tl.float32)
    z = tl.load(z_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    silu = tl.div_rn(z, 1.0 + exp(-z, INTERPRET))
    tl.store(out_ptr + row * D + cols, cast(n * silu, DT, INTERPRET), mask=mask)


def gated_rms_norm(x: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``GatedRMSNorm`` of ``x`` [rows, D] (any float dtype, e.g. the rule's float32 output; rounded
    to ``z.dtype`` first) gated by ``z``: [rows, D], or [tokens, heads, D] with tokens * heads = rows
    (Gated DeltaNet's gate, a strided view into its fused projection); ``weight`` [D] in ``z.dtype``.
    The last dims must be contiguous. Returns a new [rows, D] tensor of ``z.dtype``."""
    rows, d = x.shape
    z3 = z if z.dim() == 3 else z.unsqueeze(1)
    if z3.shape[0] * z3.shape[1] != rows or z3.shape[2] != d or weight.shape != (d,) or weight.dtype != z.dtype \
            or x.stride(-1) != 1 or z.stride(-1) != 1:
        raise ValueError(f"gated_rms_norm: x {tuple(x.shape)}, z {tuple(z.shape)}, weight {tuple(weight.shape)} "
                         f"{weight.dtype}: expected z [rows, D] or [tokens, heads, D] holding x's [rows, D], "
                         f"weight [D] of {z.dtype}, last dims contiguous")
    out = torch.empty((rows, d), dtype=z.dtype, device=z.device)
    if rows:
        block = triton.next_power_of_2(d)
        _gated_rms_norm_kernel[(rows,)](x, z3, weight, out, x.stride(0), z3.stride(0), z3.stride(1), eps,
                                        HEADS=z3.shape[1], D=d, BLOCK=block, INTERPRET=INTERPRET,
                                        num_warps=min(8, max(1, block // 256)), enable_fp_fusion=False)
    return out
