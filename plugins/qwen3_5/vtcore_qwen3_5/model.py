"""Qwen3.5 (dense and MoE) from vtcore's shared layers: a hybrid of Gated DeltaNet and gated attention.

``layer_types`` picks each layer's token mixer: ``linear_attention`` (GatedDeltaNet, state on the
hybrid cache) or ``full_attention`` (paged KV; q_proj is twice as wide, query then gate per head,
output times sigmoid(gate); zero-centred q/k norms; partial RoPE). Every RMSNorm is zero-centred
(x * (1 + w)) except the GDN output norm. MoE layers route with a float32 softmax over all experts,
top-k, renormalised, plus a shared expert scaled by sigmoid(shared_expert_gate).

Checkpoints: ``*ForCausalLM`` text weights under ``model.``, or ``*ForConditionalGeneration`` ones
under ``model.language_model.`` beside a vision tower (``model.visual.``, skipped) and, in real
releases, the multi-token-prediction head (``mtp.``: loaded into ``build_mtp_head``'s head when
speculative decoding asks for it, else skipped).
Experts load fused 3-D (``experts.gate_up_proj``) or per expert (``experts.N.gate_proj.weight``). In
an FP4 (NVFP4 / MXFP4) compressed-tensors checkpoint the experts arrive per expert as
``experts.N.{gate,up,down}_proj.weight_packed|weight_scale|weight_global_scale`` and stay packed
(vtcore's ``Experts`` under the quant method); a W4A4 checkpoint adds, for NVFP4, each projection's
static ``input_global_scale`` (MXFP4's input quantization stores nothing).
"""
from __future__ import annotations

import logging
import re

import torch
from torch import nn

from vtcore.config import HFConfig
from vtcore.layers.decoder import (FUSED_QKV_GATE_UP, CausalLM, DecoderStack, GatedMLP, PreNormDecoderLayer,
                                  QKVAttention)
from vtcore.layers.embedding import EmbedInto
from vtcore.layers.gated_deltanet import GDN_FUSED, GatedDeltaNet
from vtcore.layers.linear import Linear
from vtcore.layers.moe import Experts
from vtcore.layers.mtp import MultiTokenPredictor
from vtcore.layers.norm import RMSNorm
from vtcore.layers.rotary import RotaryEmbedding

log = logging.getLogger("vtcore")
_PER_EXPERT = re.compile(r"^((?:model|mtp)\.layers\.\d+\.mlp\.experts)\.(\d+)\.(gate|up|down)_proj\."
                         r"(weight|weight_packed|weight_scale|weight_global_scale|input_global_scale)$")
#: Our expert parameters: ``experts.gate_up_proj`` / ``experts.down_proj`` (dense, 3-D) or, packed,
#: ``experts.gate_up_weight_packed`` / ``..._weight_scale`` / ``..._weight_global_scale`` (and ``down_...``).
_EXPERT_PARAM = re.compile(r"^(.*\.experts)\.(gate_up|down)_"
                           r"(proj|weight_packed|weight_scale|weight_global_scale|input_global_scale)$")
_MTP = "mtp."
_SKIPPED_PREFIXES = {_MTP: "the multi-token-prediction head (speculative decoding only)",
                     "model.visual.": "the vision tower", "visual.": "the vision tower"}


class SparseMoE(nn.Module):
    def __init__(self, config: HFConfig) -> None:
        super().__init__()
        hidden = config.hidden_size
        self.top_k = int(config.num_experts_per_tok)
        self.gate = Linear(hidden, int(config.num_experts))
        self.experts = Experts(int(config.num_experts), hidden, int(config.moe_intermediate_size), self.top_k)
        self.shared_expert = GatedMLP(hidden, int(config.shared_expert_intermediate_size))
        self.shared_expert_gate = Linear(hidden, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.experts.fused(x):
            from vtcore.kernels.fused_moe import moe_route
            experts, weights = moe_route(self.gate(x), self.top_k)
        else:
            probs = torch.softmax(self.gate(x), dim=-1, dtype=torch.float32)
            top, experts = probs.topk(self.top_k, dim=-1)
            weights = (top / top.sum(dim=-1, keepdim=True)).to(x.dtype)
        shared = torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return self.experts(x, experts, weights) + shared


class DecoderLayer(PreNormDecoderLayer):
    def __init__(self, config: HFConfig, layer_type: str, rotary: RotaryEmbedding) -> None:
        super().__init__()
        eps = config.rms_norm_eps
        if layer_type == "linear_attention":
            self.linear_attn = GatedDeltaNet(config.hidden_size, config.linear_num_key_heads,
                                             config.linear_num_value_heads, config.linear_key_head_dim,
                                             config.linear_value_head_dim, config.linear_conv_kernel_dim, eps)
        elif layer_type == "full_attention":
            self.self_attn = QKVAttention(config, rotary, qk_norm=True, output_gate=True, zero_centered=True)
        else:
            raise ValueError(f"layer_types entry {layer_type!r}: expected 'linear_attention' or 'full_attention'")
        self.is_linear = layer_type == "linear_attention"
        self.mlp = SparseMoE(config) if config.get("num_experts") else GatedMLP(config.hidden_size,
                                                                                    config.intermediate_size)
        self.input_layernorm = RMSNorm(config.hidden_size, eps, zero_centered=True)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps, zero_centered=True)

    def mix(self, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        return self.linear_attn(x) if self.is_linear else self.self_attn(positions, x)


def layer_types_of(config: HFConfig) -> list[str]:
    """``layer_types``, or as transformers derives it when absent: every ``full_attention_interval``-th
    layer (default 4) full attention, the others linear."""
    if config.get("layer_types") is not None:
        return list(config.layer_types)
    interval = int(config.get("full_attention_interval", 4))
    return ["full_attention" if (i + 1) % interval == 0 else "linear_attention" for i in range(config.num_hidden_layers)]


class Qwen3_5ForCausalLM(CausalLM):
    packed_modules_mapping = {**FUSED_QKV_GATE_UP, **GDN_FUSED}

    def __init__(self, config: HFConfig, max_position: int) -> None:
        layer_types = layer_types_of(config)
        if len(layer_types) != config.num_hidden_layers:
            raise ValueError(f"layer_types has {len(layer_types)} entries, expected num_hidden_layers="
                             f"{config.num_hidden_layers}")
        rope = config.rope_parameters
        rotary_dim = int(config.head_dim * float(rope.get("partial_rotary_factor", 1.0)))
        rotary = RotaryEmbedding(rotary_dim, max_position, config.rope_theta, rope)
        super().__init__(config, DecoderStack(
            EmbedInto(config.vocab_size, config.hidden_size),
            [DecoderLayer(config, t, rotary) for t in layer_types],
            RMSNorm(config.hidden_size, config.rms_norm_eps, zero_centered=True)))
        self._logged: set[str] = set()

    def checkpoint_name(self, name: str) -> str | tuple[str, str] | None:
        """Map HF names to ours: drop the multimodal prefix, skip vision and (unless the MTP head is
        attached) MTP, route per-expert tensors."""
        for prefix, what in _SKIPPED_PREFIXES.items():
            if name.startswith(prefix) and not (prefix == _MTP and hasattr(self, "mtp")):
                if prefix not in self._logged:
                    self._logged.add(prefix)
                    log.info("vtcore: skipping %s (%s* tensors)", what, prefix)
                return None
        name = name.replace("model.language_model.", "model.", 1)
        match = _PER_EXPERT.match(name)
        if match:
            experts, index, proj, kind = match.groups()
            param = "proj" if kind == "weight" else kind  # experts.{gate_up,down}_proj or _weight_packed, ...
            return (f"{experts}.down_{param}", index) if proj == "down" else \
                (f"{experts}.gate_up_{param}", f"{index}.{proj}")
        return name

    def checkpoint_name_for(self, param: str, shard: str | None) -> str | None:
        """The per-expert checkpoint name of a missing expert shard (for the loader's error), dense
        (``experts.3.up_proj.weight``) or packed (``experts.3.up_proj.weight_scale``,
        ``experts.3.up_proj.input_global_scale``)."""
        match = _EXPERT_PARAM.match(param)
        if shard is None or match is None:
            return None
        experts, _, kind = match.groups()
        expert, _, part = shard.partition(".")
        return f"{experts}.{expert}.{part or 'down'}_proj.{'weight' if kind == 'proj' else kind}"


class Qwen3_5MoeForCausalLM(Qwen3_5ForCausalLM):
    """The same model; ``num_experts`` in the config turns every MLP into the sparse MoE block."""


def build_mtp_head(config: HFConfig, model: Qwen3_5ForCausalLM) -> MultiTokenPredictor:
    """The ``mtp.*`` head: zero-centred norms, ``fc`` 2H -> H, ``mtp_num_hidden_layers`` full-attention
    decoder layers (the MoE block in the MoE family) sharing the target's rotary embedding."""
    rotary = next((layer.self_attn.rotary for layer in model.model.layers if not layer.is_linear), None)
    if rotary is None:
        raise ValueError("layer_types has no full_attention layer whose RoPE the MTP head's attention could share")
    count = int(config.get("mtp_num_hidden_layers", 1))
    layers = [DecoderLayer(config, "full_attention", rotary) for _ in range(count)]
    return MultiTokenPredictor(config.hidden_size, layers, config.rms_norm_eps, zero_centered=True)
