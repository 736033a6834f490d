"""The skeleton most decoder-only families share: embed, pre-norm layers with a carried residual, final
norm, and an lm_head tied or not. A family builds its layers; these pieces run them."""
from __future__ import annotations

from typing import Callable

import torch
from torch import nn

from vtcore.config import HFConfig
from vtcore.layers.attention import Attention
from vtcore.layers.embedding import EmbedInto
from vtcore.layers import linear, parallel
from vtcore.layers.linear import Linear
from vtcore.layers.norm import RMSNorm
from vtcore.layers.rotary import RotaryEmbedding

#: HF's separate projections fused at load time: checkpoint name part -> (fused parameter, shard).
FUSED_QKV_GATE_UP = {
    "q_proj": ("qkv_proj", "q"), "k_proj": ("qkv_proj", "k"), "v_proj": ("qkv_proj", "v"),
    "gate_proj": ("gate_up_proj", "gate"), "up_proj": ("gate_up_proj", "up"),
}


class GatedMLP(nn.Module):
    """SwiGLU MLP over a fused [gate | up] projection: ``down(silu(gate) * up)``."""

    def __init__(self, hidden: int, intermediate: int, bias: bool = False) -> None:
        super().__init__()
        self.gate_up_proj = Linear(hidden, [("gate", intermediate), ("up", intermediate)], bias=bias,
                                   parallel="column")
        self.down_proj = Linear(intermediate, hidden, bias=bias, parallel="row")

    @property
    def in_proj(self) -> Linear | None:
        """gate_up_proj, whose decode GEMV then takes the norm before it as its prologue (and
        down_proj's the SwiGLU); None for a quantized gate_up_proj, whose GEMV takes no prologue
        (FP4) or which has none: the MLP then runs whole, the SwiGLU as gate_up's GEMV epilogue."""
        return self.gate_up_proj if self.gate_up_proj.quant is None else None

    def forward_projected(self, positions: torch.Tensor | None, gate_up: torch.Tensor) -> torch.Tensor:
        return self.down_proj.forward_gated(gate_up)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.gate_up_proj.forward_swiglu(x))


class QKVAttention(nn.Module):
    """GQA self-attention over a fused [q | k | v] projection, RoPE, and (``qk_norm``, Qwen3) a
    per-head RMSNorm of q and k before it; HF's ``self_attn`` names (``qkv_proj`` fused at load).
    ``output_gate`` (Qwen3.5): ``q_proj`` holds each head's query and a gate, ``[q_h | gate_h]`` per
    head, and the attention output is multiplied by ``sigmoid(gate)`` before ``o_proj``;
    ``zero_centered`` makes the q/k norms ``(1 + w)``-scaled. ``qkv_bias`` / ``o_bias``: whether
    ``qkv_proj`` (its q, k and v shards, loaded from ``q_proj.bias`` ...) and ``o_proj`` have a bias;
    None takes the config's ``attention_bias`` (default False) for that projection (Qwen2:
    ``qkv_bias=True, o_bias=False``)."""

    def __init__(self, config: HFConfig, rotary: RotaryEmbedding, qk_norm: bool = False, *,
                 output_gate: bool = False, zero_centered: bool = False, qkv_bias: bool | None = None,
                 o_bias: bool | None = None) -> None:
        super().__init__()
        hd, nq, nkv = config.head_dim, config.num_attention_heads, config.num_key_value_heads
        bias = bool(config.get("attention_bias", False))
        qkv_bias, o_bias = (bias if b is None else b for b in (qkv_bias, o_bias))
        # tensor parallelism: this rank's query heads; key/value heads split, or each rank keeps the one its
        # query heads read when there are fewer than ranks
        group = parallel.tp()
        kv_part = (group.rank, group.size) if nkv >= group.size else (group.rank * nkv // group.size, nkv)
        if nkv < group.size and group.size % nkv:
            raise ValueError(f"tensor_parallel_size={group.size} is not a multiple of num_key_value_heads={nkv}")
        q_width = (2 if output_gate else 1) * nq * hd
        self.qkv_proj = Linear(config.hidden_size, [("q", q_width), ("k", nkv * hd), ("v", nkv * hd)],
                               bias=qkv_bias, parallel="column", parts={"k": kv_part, "v": kv_part})
        self.o_proj = Linear(nq * hd, config.hidden_size, bias=o_bias, parallel="row")
        nq = parallel.split(nq, "num_attention_heads")
        nkv = nkv // kv_part[1]
        self.num_heads, self.num_kv_heads, self.head_dim = nq, nkv, hd
        self.output_gate = output_gate
        self.q_norm = RMSNorm(hd, config.rms_norm_eps, zero_centered) if qk_norm else None
        self.k_norm = RMSNorm(hd, config.rms_norm_eps, zero_centered) if qk_norm else None
        self.rotary = rotary
        self.attn = Attention(nq, nkv, hd, hd ** -0.5)

    @property
    def in_proj(self) -> Linear:
        return self.qkv_proj

    def forward_projected(self, positions: torch.Tensor, qkv: torch.Tensor) -> torch.Tensor:
        hd, nq, nkv = self.head_dim, self.num_heads, self.num_kv_heads
        q, k, v = qkv.split([self.qkv_proj.shard_slices["q"].stop, nkv * hd, nkv * hd], -1)
        if self.output_gate:
            q, gate = q.view(-1, nq, 2 * hd).chunk(2, dim=-1)
        out = self.attn(q.view(-1, nq, hd), k.view(-1, nkv, hd), v.view(-1, nkv, hd), positions, self.rotary,
                        self.q_norm, self.k_norm)
        if self.output_gate:
            out = out * torch.sigmoid(gate.reshape(out.shape))
        return self.o_proj(out)

    def forward(self, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        return self.forward_projected(positions, self.qkv_proj(x))

    def forward_normed(self, positions: torch.Tensor, x: torch.Tensor, residual: torch.Tensor, norm: RMSNorm
                       ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """``(self(positions, norm(x + residual)), x + residual)`` in fewer launches where the qkv GEMV
        can finish the attention inputs itself (one decode token, RoPE over whole heads, no output
        gate: :meth:`Linear.forward_qk_rope`); else None."""
        if self.output_gate or x.shape[0] != 1 or not linear.use_gemv(x):  # before building the operands
            return None
        rope = self.attn.decode_rope(positions, self.rotary, self.q_norm, self.k_norm)
        fused = None if rope is None else self.qkv_proj.forward_qk_rope(x, residual, norm, rope)
        if fused is None:
            return None
        qkv, residual = fused
        q = qkv[:, :self.num_heads * self.head_dim].view(-1, self.num_heads, self.head_dim)
        return self.o_proj(self.attn.attend(q)), residual


class PreNormDecoderLayer(nn.Module):
    """A pre-norm layer with the residual carried between layers: ``input_layernorm`` (adding the
    residual), ``mix`` (attention), ``post_attention_layernorm`` (adding it again), ``ffn``.

    Subclasses set the two norms and ``self_attn`` / ``mlp``, or override ``mix`` / ``ffn`` and
    ``mix_module`` / ``ffn_module``. A module whose input goes through one Linear first declares it:
    ``in_proj`` (that Linear) and ``forward_projected(positions, y)`` (the rest, so that
    ``module(x) == module.forward_projected(positions, module.in_proj(x))``); the norm (and residual
    add) before it then runs inside that Linear's GEMV on the decode path (one launch, not two). A
    module may also offer ``forward_normed(positions, x, residual, norm)``, tried first: the whole
    ``(module(norm(x + residual)), x + residual)`` or None (attention's decode path, whose qkv GEMV
    also norms, rotates and caches q/k/v).
    """

    input_layernorm: RMSNorm
    post_attention_layernorm: RMSNorm

    def mix(self, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        return self.self_attn(positions, x)

    def ffn(self, x: torch.Tensor) -> torch.Tensor:
        return self.mlp(x)

    def mix_module(self) -> nn.Module | None:
        """The module ``mix`` runs (its ``in_proj``, if any, gets the fused norm)."""
        return getattr(self, "self_attn", None)

    def ffn_module(self) -> nn.Module | None:
        """The module ``ffn`` runs (its ``in_proj``, if any, gets the fused norm)."""
        return getattr(self, "mlp", None)

    def forward(self, positions: torch.Tensor, x: torch.Tensor, residual: torch.Tensor | None
                ) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            residual, x = x, self.mix(positions, self.input_layernorm(x))
        else:
            x, residual = _norm_into(self.input_layernorm, x, residual, self.mix_module(),
                                     lambda h: self.mix(positions, h), positions)
        return _norm_into(self.post_attention_layernorm, x, residual, self.ffn_module(), self.ffn, positions)


def _norm_into(norm: RMSNorm, x: torch.Tensor, residual: torch.Tensor, module: nn.Module | None,
               run: Callable[[torch.Tensor], torch.Tensor], positions: torch.Tensor
               ) -> tuple[torch.Tensor, torch.Tensor]:
    """``(run(norm(x + residual)), x + residual)``; through ``module.forward_normed`` when the module
    has one and it applies, else ``module.in_proj.forward_rms_norm`` when the module has that (the norm
    then runs inside its GEMV when it can)."""
    fused = getattr(module, "forward_normed", None)
    done = None if fused is None else fused(positions, x, residual, norm)
    if done is not None:
        return done
    proj = getattr(module, "in_proj", None)
    if proj is not None:
        y, residual = proj.forward_rms_norm(x, residual, norm)
        return module.forward_projected(positions, y), residual
    h, residual = norm(x, residual)
    return run(h), residual


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
        self.lm_head = Linear(config.hidden_size, config.vocab_size, parallel="column")
        if tied:
            self.lm_head.weight = self.model.embed_tokens.weight
        # HF ignores a stored lm_head.weight when the embeddings are tied; so do we.
        self.skipped_tensors: tuple[str, ...] = ("lm_head.weight",) if tied else ()

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids, positions)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits over the whole vocabulary (under tensor parallelism each rank's slice, gathered)."""
        return parallel.all_gather_last(self.lm_head(hidden), self.lm_head.tp_group)
