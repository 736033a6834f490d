"""Llama (``LlamaForCausalLM``) from vtcore's shared layers: GQA, RoPE (llama3 scaling), SwiGLU."""
from __future__ import annotations

import re

import torch
from torch import nn

from vtcore.config import HFConfig
from vtcore.layers.activation import silu_and_mul
from vtcore.layers.decoder import FUSED_QKV_GATE_UP, PreNormDecoderLayer, QKVAttention
from vtcore.layers.embedding import EmbedInto
from vtcore.layers.linear import Linear
from vtcore.layers.norm import RMSNorm
from vtcore.layers.rotary import RotaryEmbedding
from vtcore.loading.weights import unfused_name

_MLP_PROJ = re.compile(r"^(layers\.\d+)\.((gate|up|down)_proj)")


class LlamaDecoderLayer(PreNormDecoderLayer):
    def __init__(self, config: HFConfig, rotary: RotaryEmbedding) -> None:
        super().__init__()
        bias = bool(config.get("mlp_bias", False))
        self.self_attn = QKVAttention(config, rotary)
        self.gate_up_proj = Linear(config.hidden_size, [("gate", config.intermediate_size),
                                                        ("up", config.intermediate_size)], bias=bias)
        self.down_proj = Linear(config.intermediate_size, config.hidden_size, bias=bias)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def ffn(self, x: torch.Tensor) -> torch.Tensor:  # the MLP's projections sit on the layer itself
        return self.down_proj(silu_and_mul(self.gate_up_proj(x)))


class LlamaForCausalLM(nn.Module):
    #: checkpoint name part -> (fused parameter, shard); the MLP's projections live under ``mlp.``
    packed_modules_mapping = FUSED_QKV_GATE_UP

    def __init__(self, config: HFConfig, max_position: int) -> None:
        super().__init__()
        rotary = RotaryEmbedding(config.head_dim, max_position, config.rope_theta, config.rope_parameters)
        self.embed_tokens = EmbedInto(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(LlamaDecoderLayer(config, rotary) for _ in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head = Linear(config.hidden_size, config.vocab_size)
        tied = bool(config.get("tie_word_embeddings", False))
        if tied:
            self.lm_head.weight = self.embed_tokens.weight
        self.skipped_tensors = ("lm_head.weight",) if tied else ()

    def checkpoint_name(self, name: str) -> str:
        """HF names (``model.layers.0.mlp.down_proj.weight``) to ours (``layers.0.down_proj.weight``)."""
        return name.removeprefix("model.").replace(".mlp.", ".")

    def checkpoint_name_for(self, param: str, shard: str | None) -> str:
        """The inverse, so the loader names a missing tensor as the checkpoint does."""
        name = unfused_name(param, shard, self.packed_modules_mapping)
        return name if name.startswith("lm_head.") else "model." + _MLP_PROJ.sub(r"\1.mlp.\2", name)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        x, residual = self.embed_tokens(input_ids), None
        for layer in self.layers:
            x, residual = layer(positions, x, residual)
        return self.norm(x, residual)[0]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)
