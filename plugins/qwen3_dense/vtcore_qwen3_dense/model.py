"""Qwen3 dense (``Qwen3ForCausalLM``) built from vtcore's shared layers.

GQA attention with per-head q/k RMSNorm before RoPE, SwiGLU MLP, fused q/k/v and gate/up
projections (fused at load from the checkpoint's separate tensors), tied or untied lm_head.
"""
from __future__ import annotations

from vtcore.config import HFConfig
from vtcore.layers.decoder import CausalLM, DecoderStack, GatedMLP, PreNormDecoderLayer, QKVAttention
from vtcore.layers.embedding import EmbedInto
from vtcore.layers.norm import RMSNorm
from vtcore.layers.rotary import RotaryEmbedding


class Qwen3DecoderLayer(PreNormDecoderLayer):
    def __init__(self, config: HFConfig, rotary: RotaryEmbedding) -> None:
        super().__init__()
        self.self_attn = QKVAttention(config, rotary, qk_norm=True)
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
