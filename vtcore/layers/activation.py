"""Activations of gated MLPs."""
from __future__ import annotations

import torch
from torch.nn import functional as F


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """SwiGLU on a fused [gate | up] projection: ``silu(gate) * up`` (one Triton kernel on CUDA)."""
    if x.is_cuda:
        from vtcore.kernels.activation import silu_and_mul as fused
        return fused(x)
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up
