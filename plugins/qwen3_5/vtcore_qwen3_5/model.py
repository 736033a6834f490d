"""Qwen3.5 (dense and MoE) from vtcore's shared layers: a hybrid of Gated DeltaNet and gated attention.

``layer_types`` picks each layer's token mixer: ``linear_attention`` (GatedDeltaNet, state on the
hybrid cache) or ``full_attention`` (paged KV; q_proj is twice as wide, query then gate per head,
output times sigmoid(gate); zero-centred q/k norms; partial RoPE). Every RMSNorm is zero-centred
(x * (1 + w)) except the GDN output norm. MoE layers route with a float32 softmax over all experts,
top-k, renormalised, plus a shared expert scaled by sigmoid(shared_expert_gate).

Checkpoints: ``*ForCausalLM`` text weights under ``model.``, or ``*ForConditionalGeneration`` ones
under ``model.language_model.`` beside a vision tower (``model.visual.``, skipped) and, in real
releases, the multi-token-prediction head (``mtp.``, used only for speculative decoding, skipped).
Experts load fused 3-D (``experts.gate_up_proj``) or per expert (``experts.N.gate_proj.weight``).
"""
from __future__ import annotations

import logging
import math
import re

import torch
from torch import nn
from torch.nn import functional as F

from vtcore.config import HFConfig
from vtcore.layers.activation import silu_and_mul
from vtcore.layers.attention import Attention
from vtcore.layers.embedding import EmbedInto
from vtcore.layers.gated_deltanet import GatedDeltaNet
from vtcore.layers.linear import Linear
from vtcore.layers.norm import RMSNorm
from vtcore.layers.rotary import RotaryEmbedding

log = logging.getLogger("vtcore")
_PER_EXPERT = re.compile(r"^(model\.layers\.\d+\.mlp\.experts)\.(\d+)\.(gate|up|down)_proj\.weight$")
_SKIPPED_PREFIXES = {"mtp.": "the multi-token-prediction head (speculative decoding only)",
                     "model.visual.": "the vision tower", "visual.": "the vision tower"}


class GatedAttention(nn.Module):
    def __init__(self, config: HFConfig, rotary: RotaryEmbedding) -> None:
        super().__init__()
        hd, nq, nkv = config.head_dim, config.num_attention_heads, config.num_key_value_heads
        self.nq, self.nkv, self.hd = nq, nkv, hd
        self.qkv_proj = Linear(config.hidden_size, [("q", 2 * nq * hd), ("k", nkv * hd), ("v", nkv * hd)],
                               bias=bool(config.get("attention_bias", False)))
        self.o_proj = Linear(nq * hd, config.hidden_size, bias=bool(config.get("attention_bias", False)))
        self.q_norm = RMSNorm(hd, config.rms_norm_eps, zero_centered=True)
        self.k_norm = RMSNorm(hd, config.rms_norm_eps, zero_centered=True)
        self.rotary = rotary
        self.attn = Attention(nq, nkv, hd, hd ** -0.5)

    def forward(self, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        qg, k, v = self.qkv_proj(x).split([2 * self.nq * self.hd, self.nkv * self.hd, self.nkv * self.hd], -1)
        q, gate = qg.view(-1, self.nq, 2 * self.hd).chunk(2, dim=-1)
        q, k = self.rotary(positions, self.q_norm(q), self.k_norm(k.view(-1, self.nkv, self.hd)))
        out = self.attn(q, k, v.view(-1, self.nkv, self.hd))
        return self.o_proj(out * torch.sigmoid(gate.reshape(out.shape)))


class MLP(nn.Module):
    def __init__(self, hidden: int, intermediate: int) -> None:
        super().__init__()
        self.gate_up_proj = Linear(hidden, [("gate", intermediate), ("up", intermediate)])
        self.down_proj = Linear(intermediate, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(silu_and_mul(self.gate_up_proj(x)))


class Experts(nn.Module):
    """Expert weights as 3-D tensors ([E, 2I, H] gate|up and [E, H, I] down), loadable fused or per expert."""

    def __init__(self, num_experts: int, hidden: int, intermediate: int) -> None:
        super().__init__()
        self.num_experts, self.intermediate = num_experts, intermediate
        self.gate_up_proj = self._param((num_experts, 2 * intermediate, hidden),
                                        [f"{e}.{p}" for e in range(num_experts) for p in ("gate", "up")])
        self.down_proj = self._param((num_experts, hidden, intermediate), [str(e) for e in range(num_experts)])

    def _param(self, shape: tuple[int, ...], shards: list[str]) -> nn.Parameter:
        param = nn.Parameter(torch.empty(shape), requires_grad=False)
        param.shards = tuple(shards)
        param.weight_loader = self.weight_loader
        return param

    def shard_view(self, param: nn.Parameter, shard: str | None) -> torch.Tensor:
        """Whole 3-D tensors (``shard=None``) or one expert's matrix (``"3.gate"``, ``"3.up"``, ``"3"``)."""
        target = param.data
        if shard is not None:
            expert, _, part = shard.partition(".")
            if not 0 <= int(expert) < self.num_experts:
                raise ValueError(f"expert index {expert} outside num_experts={self.num_experts}")
            target = target[int(expert)]
            if part:
                target = target[:self.intermediate] if part == "gate" else target[self.intermediate:]
        return target

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard: str | None = None) -> None:
        target = self.shard_view(param, shard)
        if tuple(target.shape) != tuple(loaded.shape):
            raise ValueError(f"shape {tuple(loaded.shape)}, expected {tuple(target.shape)}")
        target.copy_(loaded)

    def dummy_init(self, gen: torch.Generator) -> None:
        for p in (self.gate_up_proj, self.down_proj):
            p.copy_(torch.randn(p.shape, generator=gen, device=p.device) / math.sqrt(p.shape[-1]))

    def forward(self, x: torch.Tensor, experts: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        out = torch.zeros_like(x)
        for e in experts.unique().tolist():
            token, slot = torch.where(experts == e)
            h = silu_and_mul(F.linear(x[token], self.gate_up_proj[e]))
            out.index_add_(0, token, F.linear(h, self.down_proj[e]) * weights[token, slot, None])
        return out


class SparseMoE(nn.Module):
    def __init__(self, config: HFConfig) -> None:
        super().__init__()
        hidden = config.hidden_size
        self.top_k = int(config.num_experts_per_tok)
        self.gate = Linear(hidden, int(config.num_experts))
        self.experts = Experts(int(config.num_experts), hidden, int(config.moe_intermediate_size))
        self.shared_expert = MLP(hidden, int(config.shared_expert_intermediate_size))
        self.shared_expert_gate = Linear(hidden, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        probs = torch.softmax(self.gate(x), dim=-1, dtype=torch.float32)
        top, experts = probs.topk(self.top_k, dim=-1)
        weights = (top / top.sum(dim=-1, keepdim=True)).to(x.dtype)
        shared = torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return self.experts(x, experts, weights) + shared


class DecoderLayer(nn.Module):
    def __init__(self, config: HFConfig, layer_type: str, rotary: RotaryEmbedding) -> None:
        super().__init__()
        eps = config.rms_norm_eps
        if layer_type == "linear_attention":
            self.linear_attn = GatedDeltaNet(config.hidden_size, config.linear_num_key_heads,
                                             config.linear_num_value_heads, config.linear_key_head_dim,
                                             config.linear_value_head_dim, config.linear_conv_kernel_dim, eps)
        elif layer_type == "full_attention":
            self.self_attn = GatedAttention(config, rotary)
        else:
            raise ValueError(f"layer_types entry {layer_type!r}: expected 'linear_attention' or 'full_attention'")
        self.mixer = self.linear_attn if layer_type == "linear_attention" else self.self_attn
        self.is_linear = layer_type == "linear_attention"
        self.mlp = SparseMoE(config) if config.get("num_experts") else MLP(config.hidden_size, config.intermediate_size)
        self.input_layernorm = RMSNorm(config.hidden_size, eps, zero_centered=True)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps, zero_centered=True)

    def forward(self, positions: torch.Tensor, x: torch.Tensor, residual: torch.Tensor | None
                ) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            residual, x = x, self.input_layernorm(x)
        else:
            x, residual = self.input_layernorm(x, residual)
        x = self.linear_attn(x) if self.is_linear else self.self_attn(positions, x)
        x, residual = self.post_attention_layernorm(x, residual)
        return self.mlp(x), residual


class Qwen3_5Model(nn.Module):
    def __init__(self, config: HFConfig, max_position: int) -> None:
        super().__init__()
        rope = config.rope_parameters
        rotary_dim = int(config.head_dim * float(rope.get("partial_rotary_factor", 1.0)))
        rotary = RotaryEmbedding(rotary_dim, max_position, config.rope_theta, rope)
        self.embed_tokens = EmbedInto(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config, t, rotary) for t in config.layer_types)
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, zero_centered=True)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        x, residual = self.embed_tokens(input_ids), None
        for layer in self.layers:
            x, residual = layer(positions, x, residual)
        return self.norm(x, residual)[0]


class Qwen3_5ForCausalLM(nn.Module):
    packed_modules_mapping = {
        "q_proj": ("qkv_proj", "q"), "k_proj": ("qkv_proj", "k"), "v_proj": ("qkv_proj", "v"),
        "gate_proj": ("gate_up_proj", "gate"), "up_proj": ("gate_up_proj", "up"),
    }

    def __init__(self, config: HFConfig, max_position: int) -> None:
        super().__init__()
        if len(config.layer_types) != config.num_hidden_layers:
            raise ValueError(f"layer_types has {len(config.layer_types)} entries, expected num_hidden_layers="
                             f"{config.num_hidden_layers}")
        self.model = Qwen3_5Model(config, max_position)
        self.lm_head = Linear(config.hidden_size, config.vocab_size)
        tied = bool(config.get("tie_word_embeddings", False))
        if tied:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.skipped_tensors = ("lm_head.weight",) if tied else ()
        self._logged: set[str] = set()

    def checkpoint_name(self, name: str) -> str | tuple[str, str] | None:
        """Map HF names to ours: drop the multimodal prefix, skip vision and MTP, route per-expert tensors."""
        for prefix, what in _SKIPPED_PREFIXES.items():
            if name.startswith(prefix):
                if prefix not in self._logged:
                    self._logged.add(prefix)
                    log.info("vtcore: skipping %s (%s* tensors)", what, prefix)
                return None
        name = name.replace("model.language_model.", "model.", 1)
        match = _PER_EXPERT.match(name)
        if match:
            experts, index, proj = match.groups()
            return (f"{experts}.down_proj", index) if proj == "down" else (f"{experts}.gate_up_proj", f"{index}.{proj}")
        return name

    def checkpoint_name_for(self, param: str, shard: str | None) -> str | None:
        """The per-expert checkpoint name of a missing expert shard (for the loader's error)."""
        if shard is None or not param.endswith((".experts.gate_up_proj", ".experts.down_proj")):
            return None
        experts, _, fused = param.rpartition(".")
        expert, _, part = shard.partition(".")
        return f"{experts}.{expert}.{part or 'down'}_proj.weight"

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids, positions)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)


class Qwen3_5MoeForCausalLM(Qwen3_5ForCausalLM):
    """The same model; ``num_experts`` in the config turns every MLP into the sparse MoE block."""
