"""Rotary position embedding (RoPE), full or partial, with a float32 cos/sin cache.

RoPE types (HF's ``rope_parameters["rope_type"]``): ``default`` and ``llama3`` (Llama 3.1's
frequency-dependent scaling). Anything else is refused by name.
"""
from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from vtcore.errors import NotSupportedError

ROPE_TYPES = ("default", "llama3")


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def inverse_frequencies(rotary_dim: int, theta: float, rope_parameters: dict[str, Any] | None = None) -> torch.Tensor:
    """The per-channel-pair inverse frequencies, as HF computes them, float32."""
    params = rope_parameters or {}
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in ROPE_TYPES:
        raise NotSupportedError(f"rope_type={rope_type!r}: expected one of {ROPE_TYPES}")
    inv_freq = 1.0 / (theta ** (torch.arange(0, rotary_dim, 2, dtype=torch.int64).float() / rotary_dim))
    if rope_type == "llama3":
        factor, low, high = params["factor"], params["low_freq_factor"], params["high_freq_factor"]
        old_len = params["original_max_position_embeddings"]
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = ~(wavelen < old_len / high) * ~(wavelen > old_len / low)
        inv_freq = torch.where(medium, smoothed, scaled)
    return inv_freq


class RotaryEmbedding(nn.Module):
    """Applies RoPE to the first ``rotary_dim`` channels of each head (HF's rotate-half layout)."""

    def __init__(self, rotary_dim: int, max_position: int, theta: float,
                 rope_parameters: dict[str, Any] | None = None) -> None:
        super().__init__()
        if rotary_dim % 2:
            raise ValueError(f"rotary_dim={rotary_dim}: expected an even number")
        self.rotary_dim = rotary_dim
        inv_freq = inverse_frequencies(rotary_dim, theta, rope_parameters)
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
