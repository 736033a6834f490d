"""RMSNorm, with the residual add fused in, as HF computes it (float32 statistics)."""
from __future__ import annotations

import torch
from torch import nn


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, zero_centered: bool = False) -> torch.Tensor:
    """HF's RMSNorm over the last dim: ``h = x.float() * rsqrt(mean(h^2) + eps)``, then
    ``weight * h.to(x.dtype)`` (the cast first: a bf16 weight gives a bf16 product), or zero-centred
    ``(h * (1 + weight.float())).to(x.dtype)``. Pure torch: the reference of ``vtcore.kernels.rmsnorm``
    and ``vtcore.kernels.rope``, so it must not dispatch to those kernels."""
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    if zero_centered:
        return (h * (1.0 + weight.float())).to(x.dtype)
    return weight * h.to(x.dtype)


class RMSNorm(nn.Module):
    """``x / rms(x) * w``; ``zero_centered`` gives Qwen3.5's ``x / rms(x) * (1 + w)``."""

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
            from vtcore.kernels import rmsnorm

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
