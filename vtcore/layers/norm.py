"""RMSNorm, with the residual add fused in, as HF computes it (float32 statistics)."""
from __future__ import annotations

import torch
from torch import nn


class RMSNorm(nn.Module):
    """``x / rms(x) * w``; ``zero_centered`` gives Qwen3.5's ``x / rms(x) * (1 + w)``."""

    def __init__(self, hidden_size: int, eps: float = 1e-6, zero_centered: bool = False) -> None:
        super().__init__()
        self.eps = eps
        self.zero_centered = zero_centered
        self.weight = nn.Parameter(torch.empty(hidden_size), requires_grad=False)

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        if self.zero_centered:
            return (h * (1.0 + self.weight.float())).to(x.dtype)
        return self.weight * h.to(x.dtype)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None
                ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Normalise ``x``; with ``residual``, first add it and return (normed, new residual)."""
        if residual is None:
            return self._norm(x)
        x = residual + x
        return self._norm(x), x
