"""Activations of gated MLPs."""
from __future__ import annotations

import torch

from vtcore.kernels import activation as kernels


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """SwiGLU on a fused [gate | up] projection: ``silu(gate) * up`` (one Triton kernel on CUDA, its
    torch reference elsewhere)."""
    return kernels.silu_and_mul(x) if x.is_cuda else kernels.silu_and_mul_ref(x)
