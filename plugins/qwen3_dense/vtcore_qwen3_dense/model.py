"""Qwen3 dense (``Qwen3ForCausalLM``) built from vtcore's shared layers.

GQA attention with per-head q/k RMSNorm before RoPE, SwiGLU MLP, fused q/k/v and gate/up
projections (fused at load from the checkpoint's separate tensors), tied or untied lm_head.
"""
from __future__ import annotations

import torch
from torch import nn

from vtcore.config import HFConfig
from vtcore.layers.activation import silu_and_mul
from vtcore.layers.attention import Attention
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

    def forward(self, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv_proj(x).split(
            [self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim, self.num_kv_heads * self.head_dim], -1)
        q = self.q_norm(q.view(-1, self.num_heads, self.head_dim))
        k = self.k_norm(k.view(-1, self.num_kv_heads, self.head_dim))
        q, k = self.rotary(positions, q, k)
        return self.o_proj(self.attn(q, k, v.view(-1, self.num_kv_heads, self.head_dim)))


class Qwen3MLP(nn.Module):
    def __init__(self, hidden: int, intermediate: int) -> None:
        super().__init__()
        self.gate_up_proj = Linear(hidden, [("gate", intermediate), ("up", intermediate)])
        self.down_proj = Linear(intermediate, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(silu_and_mul(self.gate_up_proj(x)))


class Qwen3DecoderLayer(nn.Module):
    def __init__(self, config: HFConfig, rotary: RotaryEmbedding) -> None:
        super().__init__()
        self.self_attn = Qwen3Attention(config, rotary)
        self.mlp = Qwen3MLP(config.hidden_size, config.intermediate_size)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, positions: torch.Tensor, x: torch.Tensor, residual: torch.Tensor | None
                ) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            residual, x = x, self.input_layernorm(x)
        else:
            x, residual = self.input_layernorm(x, residual)
        x = self.self_attn(positions, x)
        x, residual = self.post_attention_layernorm(x, residual)
        return self.mlp(x), residual


class Qwen3Model(nn.Module):
    def __init__(self, config: HFConfig, max_position: int) -> None:
        super().__init__()
        rotary = RotaryEmbedding(config.head_dim, max_position, config.rope_theta, config.rope_parameters)
        self.embed_tokens = EmbedInto(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(Qwen3DecoderLayer(config, rotary) for _ in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        x, residual = self.embed_tokens(input_ids), None
        for layer in self.layers:
            x, residual = layer(positions, x, residual)
        return self.norm(x, residual)[0]


class Qwen3ForCausalLM(nn.Module):
    #: checkpoint projection -> (fused parameter, shard)
    packed_modules_mapping = {
        "q_proj": ("qkv_proj", "q"), "k_proj": ("qkv_proj", "k"), "v_proj": ("qkv_proj", "v"),
        "gate_proj": ("gate_up_proj", "gate"), "up_proj": ("gate_up_proj", "up"),
    }

    def __init__(self, config: HFConfig, max_position: int) -> None:
        super().__init__()
        self.model = Qwen3Model(config, max_position)
        self.tie_word_embeddings = bool(config.get("tie_word_embeddings", False))
        self.lm_head = Linear(config.hidden_size, config.vocab_size)
        if self.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        # HF ignores a stored lm_head.weight when the embeddings are tied; so do we.
        self.skipped_tensors = ("lm_head.weight",) if self.tie_word_embeddings else ()

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids, positions)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)
