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
from vtcore.kernels import rope
from vtcore.kernels.paged_attention import write_kv_cache_ref

ROPE_TYPES = ("default", "llama3")


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

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, q_norm: nn.Module | None = None,
                k_norm: nn.Module | None = None, kv_cache: tuple[torch.Tensor, ...] | None = None
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """``q`` and ``k`` are [tokens, heads, head_dim]; ``positions`` is [tokens]. ``q_norm`` / ``k_norm``
        (per-head ``RMSNorm``, Qwen3's q/k norm) run first. ``kv_cache`` = ``(v, k_cache, v_cache,
        slot_mapping)`` also writes the rotated k and v into the paged cache, and zeroes the k and v of
        padded rows (negative slots), as ``write_kv_cache`` does.
        On CUDA one fused Triton kernel does all of it, in place in ``q`` and ``k`` (views into the
        fused qkv projection); elsewhere its torch reference and ``write_kv_cache_ref``."""
        weights = (q_norm.weight if q_norm else None, k_norm.weight if k_norm else None)
        norm = q_norm or k_norm
        eps, zero_centered = (norm.eps, bool(norm.zero_centered)) if norm else (0.0, False)
        if q.is_cuda:
            v, k_cache, v_cache, slots = kv_cache or (None,) * 4
            return rope.qk_norm_rope(q, k, *weights, eps, self.cos_cache, self.sin_cache, positions, self.rotary_dim,
                                     zero_centered, v=v, k_cache=k_cache, v_cache=v_cache, slot_mapping=slots)
        q, k = rope.qk_norm_rope_ref(q, k, *weights, eps, self.cos_cache, self.sin_cache, positions, self.rotary_dim,
                                     zero_centered)
        if kv_cache is not None:
            v, k_cache, v_cache, slots = kv_cache
            write_kv_cache_ref(k, v, k_cache, v_cache, slots)
        return q, k

