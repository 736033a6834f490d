"""Qwen2 (``Qwen2ForCausalLM``) from vtcore's shared layers: Llama's decoder with a bias on the q, k
and v projections (none on o_proj) and no q/k norm. Full attention only: a config with sliding-window
layers is refused."""
from __future__ import annotations

from vtcore.config import HFConfig
from vtcore.errors import NotSupportedError
from vtcore.layers.decoder import CausalLM, DecoderStack, GatedMLP, PreNormDecoderLayer, QKVAttention
from vtcore.layers.embedding import EmbedInto
from vtcore.layers.norm import RMSNorm
from vtcore.layers.rotary import RotaryEmbedding


class Qwen2DecoderLayer(PreNormDecoderLayer):
    def __init__(self, config: HFConfig, rotary: RotaryEmbedding) -> None:
        super().__init__()
        self.self_attn = QKVAttention(config, rotary, qkv_bias=True, o_bias=False)
        self.mlp = GatedMLP(config.hidden_size, config.intermediate_size)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)


class Qwen2ForCausalLM(CausalLM):
    def __init__(self, config: HFConfig, max_position: int) -> None:
        if config.get("use_sliding_window", False) or "sliding_attention" in (config.get("layer_types") or ()):
            raise NotSupportedError("Qwen2 sliding-window attention (use_sliding_window / layer_types): vtcore's "
                                    "attention sees the whole context")
        rotary = RotaryEmbedding(config.head_dim, max_position, config.rope_theta, config.rope_parameters)
        super().__init__(config, DecoderStack(
            EmbedInto(config.vocab_size, config.hidden_size),
            [Qwen2DecoderLayer(config, rotary) for _ in range(config.num_hidden_layers)],
            RMSNorm(config.hidden_size, config.rms_norm_eps)))
