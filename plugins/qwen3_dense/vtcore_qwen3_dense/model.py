"""Qwen3 dense (``Qwen3ForCausalLM``) built from vtcore's shared layers.

GQA attention with per-head q/k RMSNorm before RoPE, SwiGLU MLP, fused q/k/v and gate/up
projections (fused at load from the checkpoint's separate tensors), tied or untied lm_head.
"""
from __future__ import annotations

import torch
from torch import nn

from vtcore.config import HFConfig
from vtcore.layers.attention import Attention
from vtcore.layers.decoder import CausalLM, DecoderStack, GatedMLP, PreNormDecoderLayer
from vtcore.layers.embedding import EmbedInto
from vtcore.layers.linear import Linear
from vtcore.layers.norm import RMSNorm
from vtcore.layers.rotary import RotaryEmbedding


class Qwen3Attention(nn.Module):
    def __init__(self, config: HFConfig, rotary: RotaryEmbedding) -> None:
        super().__init__()
        hd, nq, nkv = config.head_dim, config.num_attention_heads, config.num_key_value_heads
        bias = bool(config.get("attention_bias", False))
        self.num_heads, self.num_kv_heads, self.head_dim = nq, nkv, hd
        self.qkv_proj = Linear(config.hidden_size, [("q", nq * hd), ("k", nkv * hd), ("v", nkv * hd)], bias=bias)
        self.o_proj = Linear(nq * hd, config.hidden_size, bias=bias)
        self.q_norm = RMSNorm(hd, config.rms_norm_eps)
        self.k_norm = RMSNorm(hd, config.rms_norm_eps)
        self.rotary = rotary
        self.attn = Attention(nq, nkv, hd, hd ** -0.5)

    @property
    def in_proj(self) -> Linear:
        return self.qkv_proj

    def forward_projected(self, positions: torch.Tensor, qkv: torch.Tensor) -> torch.Tensor:
        q, k, v = qkv.split(
            [self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim, self.num_kv_heads * self.head_dim], -1)
        out = self.attn(q.view(-1, self.num_heads, self.head_dim), k.view(-1, self.num_kv_heads, self.head_dim),
                        v.view(-1, self.num_kv_heads, self.head_dim), positions, self.rotary, self.q_norm, self.k_norm)
        return self.o_proj(out)

    def forward(self, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        return self.forward_projected(positions, self.qkv_proj(x))


class Qwen3DecoderLayer(PreNormDecoderLayer):
    def __init__(self, config: HFConfig, rotary: RotaryEmbedding) -> None:
        super().__init__()
        self.self_attn = Qwen3Attention(config, rotary)
        self.mlp = GatedMLP(config.hidden_size, config.intermediate_size)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)


class Qwen3ForCausalLM(CausalLM):
    def __init__(self, config: HFConfig, max_position: int) -> None:
        rotary = RotaryEmbedding(config.head_dim, max_position, config.rope_theta, config.rope_parameters)
        super().__init__(config, DecoderStack(
            EmbedInto(config.vocab_size, config.hidden_size),
            [Qwen3DecoderLayer(config, rotary) for _ in range(config.num_hidden_layers)],
            RMSNorm(config.hidden_size, config.rms_norm_eps)))
