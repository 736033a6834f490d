"""RMSNorm, with the residual add fused in, as HF computes it (float32 statistics).

``rms_norm`` is the torch RMSNorm (:func:`vtcore.kernels.rmsnorm.rms_norm_ref`), for a family that
norms by hand; ``RMSNorm`` runs it on CPU and :mod:`vtcore.kernels.rmsnorm`'s kernels on CUDA.
"""
from __future__ import annotations

import torch
from torch import nn

from vtcore.kernels import rmsnorm
from vtcore.kernels.rmsnorm import rms_norm_ref as rms_norm

__all__ = ["RMSNorm", "rms_norm"]


class RMSNorm(nn.Module):
    """``x / rms(x) * w``; ``zero_centered`` gives Qwen3.5's ``x / rms(x) * (1 + w)``."""

    tp_replicated = True  # under tensor parallelism every rank holds the whole weight

    def __init__(self, hidden_size: int, eps: float = 1e-6, zero_centered: bool = False) -> None:
        super().__init__()
        self.eps = eps
        self.zero_centered = zero_centered
        self.weight = nn.Parameter(torch.empty(hidden_size), requires_grad=False)

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps, self.zero_centered)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None
                ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Normalise ``x``; with ``residual``, first add it and return (normed, new residual).
        On CUDA one Triton kernel does each (the add and the norm fused)."""
        if x.is_cuda:
            flat = x.reshape(-1, x.shape[-1])
            if residual is None:
                return rmsnorm.rms_norm(flat, self.weight, self.eps, self.zero_centered).view(x.shape)
            out, residual = rmsnorm.fused_add_rms_norm(flat, residual.reshape(flat.shape), self.weight, self.eps,
                                                       self.zero_centered)
            return out.view(x.shape), residual.view(x.shape)
        if residual is None:
            return self._norm(x)
        x = residual + x
        return self._norm(x), x
