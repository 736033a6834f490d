"""Rotary position embedding (RoPE), full or partial, with a float32 cos/sin cache."""
from __future__ import annotations

import torch
from torch import nn

from vtcore.errors import NotSupportedError


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class RotaryEmbedding(nn.Module):
    """Applies RoPE to the first ``rotary_dim`` channels of each head (HF's rotate-half layout)."""

    def __init__(self, rotary_dim: int, max_position: int, theta: float, rope_type: str = "default") -> None:
        super().__init__()
        if rope_type != "default":
            raise NotSupportedError(f"rope_type={rope_type!r}: only 'default' RoPE is implemented")
        if rotary_dim % 2:
            raise ValueError(f"rotary_dim={rotary_dim}: expected an even number")
        self.rotary_dim = rotary_dim
        inv_freq = 1.0 / (theta ** (torch.arange(0, rotary_dim, 2, dtype=torch.int64).float() / rotary_dim))
        freqs = torch.outer(torch.arange(max_position, dtype=torch.float32), inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)
        self.register_buffer("cos_cache", emb.cos(), persistent=False)
        self.register_buffer("sin_cache", emb.sin(), persistent=False)

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """``q`` and ``k`` are [tokens, heads, head_dim]; ``positions`` is [tokens]."""
        cos = self.cos_cache[positions].unsqueeze(1).to(q.dtype)
        sin = self.sin_cache[positions].unsqueeze(1).to(q.dtype)
        return self._apply(q, cos, sin), self._apply(k, cos, sin)

    def _apply(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        d = self.rotary_dim
        if d == x.shape[-1]:
            return x * cos + _rotate_half(x) * sin
        rot, rest = x[..., :d], x[..., d:]
        return torch.cat((rot * cos + _rotate_half(rot) * sin, rest), dim=-1)
