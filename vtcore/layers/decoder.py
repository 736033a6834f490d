"""The skeleton most decoder-only families share: embed, pre-norm layers with a carried residual, final
norm, and an lm_head tied or not. A family builds its layers; these pieces run them."""
from __future__ import annotations

import torch
from torch import nn

from vtcore.config import HFConfig
from vtcore.layers.activation import silu_and_mul
from vtcore.layers.embedding import EmbedInto
from vtcore.layers.linear import Linear
from vtcore.layers.norm import RMSNorm

#: HF's separate projections fused at load time: checkpoint name part -> (fused parameter, shard).
FUSED_QKV_GATE_UP = {
    "q_proj": ("qkv_proj", "q"), "k_proj": ("qkv_proj", "k"), "v_proj": ("qkv_proj", "v"),
    "gate_proj": ("gate_up_proj", "gate"), "up_proj": ("gate_up_proj", "up"),
}


class GatedMLP(nn.Module):
    """SwiGLU MLP over a fused [gate | up] projection: ``down(silu(gate) * up)``."""

    def __init__(self, hidden: int, intermediate: int, bias: bool = False) -> None:
        super().__init__()
        self.gate_up_proj = Linear(hidden, [("gate", intermediate), ("up", intermediate)], bias=bias)
        self.down_proj = Linear(intermediate, hidden, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(silu_and_mul(self.gate_up_proj(x)))


class PreNormDecoderLayer(nn.Module):
    """A pre-norm layer with the residual carried between layers: ``input_layernorm`` (adding the
    residual), ``mix`` (attention), ``post_attention_layernorm`` (adding it again), ``ffn``.

    Subclasses set the two norms and ``self_attn`` / ``mlp``, or override ``mix`` / ``ffn``.
    """

    input_layernorm: RMSNorm
    post_attention_layernorm: RMSNorm

    def mix(self, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        return self.self_attn(positions, x)

    def ffn(self, x: torch.Tensor) -> torch.Tensor:
        return self.mlp(x)

    def forward(self, positions: torch.Tensor, x: torch.Tensor, residual: torch.Tensor | None
                ) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            residual, x = x, self.input_layernorm(x)
        else:
            x, residual = self.input_layernorm(x, residual)
        x, residual = self.post_attention_layernorm(self.mix(positions, x), residual)
        return self.ffn(x), residual


class DecoderStack(nn.Module):
    """``embed_tokens`` -> each layer ``(positions, x, residual) -> (x, residual)`` -> ``norm(x + residual)``.

    Named as HF's ``model.`` submodule so checkpoint names map one to one.
    """

    def __init__(self, embed_tokens: EmbedInto, layers: list[nn.Module], norm: RMSNorm) -> None:
        super().__init__()
        self.embed_tokens = embed_tokens
        self.layers = nn.ModuleList(layers)
        self.norm = norm

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        x, residual = self.embed_tokens(input_ids), None
        for layer in self.layers:
            x, residual = layer(positions, x, residual)
        return self.norm(x, residual)[0]


class CausalLM(nn.Module):
    """A ``DecoderStack`` as ``self.model`` and an ``lm_head`` (tied to the embeddings when the config says)."""

    packed_modules_mapping = FUSED_QKV_GATE_UP

    def __init__(self, config: HFConfig, model: DecoderStack) -> None:
        super().__init__()
        self.model = model
        tied = bool(config.get("tie_word_embeddings", False))
        self.lm_head = Linear(config.hidden_size, config.vocab_size)
        if tied:
            self.lm_head.weight = self.model.embed_tokens.weight
        # HF ignores a stored lm_head.weight when the embeddings are tied; so do we.
        self.skipped_tensors: tuple[str, ...] = ("lm_head.weight",) if tied else ()

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids, positions)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)
