"""Qwen3.5 (dense and MoE) from vtcore's shared layers: a hybrid of Gated DeltaNet and gated attention.

``layer_types`` picks each layer's token mixer: ``linear_attention`` (GatedDeltaNet, state on the
hybrid cache) or ``full_attention`` (paged KV; q_proj is twice as wide, query then gate per head,
output times sigmoid(gate); zero-centred q/k norms; partial RoPE). Every RMSNorm is zero-centred
(x * (1 + w)) except the GDN output norm. MoE layers route with a float32 softmax over all experts,
top-k, renormalised, plus a shared expert scaled by sigmoid(shared_expert_gate).

Checkpoints: ``*ForCausalLM`` text weights under ``model.``, or ``*ForConditionalGeneration`` ones
under ``model.language_model.`` beside a vision tower (``model.visual.``, skipped) and, in real
releases, the multi-token-prediction head (``mtp.``, used only for speculative decoding, skipped).
Experts load fused 3-D (``experts.gate_up_proj``) or per expert (``experts.N.gate_proj.weight``). In
an FP4 (NVFP4 / MXFP4) compressed-tensors checkpoint the experts arrive per expert as
``experts.N.{gate,up,down}_proj.weight_packed|weight_scale|weight_global_scale`` and stay packed
(``Experts.fp4_take_over``); a W4A4 checkpoint adds, for NVFP4, each projection's static
``input_global_scale`` (MXFP4's input quantization stores nothing).
"""
from __future__ import annotations

import logging
import math
import re
from typing import Any, Callable

import torch
from torch import nn
from torch.nn import functional as F

from vtcore.config import HFConfig
from vtcore.errors import CheckpointError
from vtcore.layers.activation import silu_and_mul
from vtcore.layers.decoder import (FUSED_QKV_GATE_UP, CausalLM, DecoderStack, GatedMLP, PreNormDecoderLayer,
                                  QKVAttention)
from vtcore.layers.embedding import EmbedInto
from vtcore.layers.gated_deltanet import GDN_FUSED, GatedDeltaNet
from vtcore.layers.linear import Linear
from vtcore.layers.norm import RMSNorm
from vtcore.layers.rotary import RotaryEmbedding

log = logging.getLogger("vtcore")
_PER_EXPERT = re.compile(r"^(model\.layers\.\d+\.mlp\.experts)\.(\d+)\.(gate|up|down)_proj\."
                         r"(weight|weight_packed|weight_scale|weight_global_scale|input_global_scale)$")
#: Our expert parameters: ``experts.gate_up_proj`` / ``experts.down_proj`` (dense, 3-D) or, packed,
#: ``experts.gate_up_weight_packed`` / ``..._weight_scale`` / ``..._weight_global_scale`` (and ``down_...``).
_EXPERT_PARAM = re.compile(r"^(.*\.experts)\.(gate_up|down)_"
                           r"(proj|weight_packed|weight_scale|weight_global_scale|input_global_scale)$")
_SKIPPED_PREFIXES = {"mtp.": "the multi-token-prediction head (speculative decoding only)",
                     "model.visual.": "the vision tower", "visual.": "the vision tower"}


class Experts(nn.Module):
    """Expert weights as 3-D tensors ([E, 2I, H] gate|up and [E, H, I] down), loadable fused or per expert.

    Under an FP4 quant method (``fp4_take_over``) they are held packed instead, never dense:
    ``gate_up_weight_packed`` uint8 [E, 2I, H/2], ``gate_up_weight_scale`` [E, 2I, H/g] and, for NVFP4,
    ``gate_up_weight_global_scale`` float32 [E, 2] (gate, up); ``down_weight_packed`` [E, H, I/2],
    ``down_weight_scale`` [E, H, I/g], ``down_weight_global_scale`` [E, 1]. Each is filled per expert
    from the checkpoint's ``experts.{e}.{gate,up,down}_proj.{weight_packed,...}`` tensors.

    W4A4 (the method's ``quantize_inputs``): each expert's input is fake-quantized with
    ``method.quantize_input`` before its gate_up matmul and again before its down matmul
    (``fp4_quantizes_inputs``). NVFP4 keeps the static per-expert input global scales as float32
    ``gate_up_input_global_scale`` [E, 2] (gate, up) and ``down_input_global_scale`` [E, 1], from
    ``experts.{e}.{gate,up,down}_proj.input_global_scale``. Gate and up see the same input, so they
    must hold one value (compressed-tensors/llm-compressor calibrate them on the same tensor):
    differing values are refused at load, naming both tensors; the forward uses the gate's.
    MXFP4's input quantization is fully dynamic: nothing is stored.
    """

    def __init__(self, num_experts: int, hidden: int, intermediate: int, top_k: int = 1) -> None:
        super().__init__()
        self.num_experts, self.hidden, self.intermediate = num_experts, hidden, intermediate
        self.top_k = top_k  # experts a token uses (for active_fraction)
        self.gate_up_proj = self._param(torch.empty(num_experts, 2 * intermediate, hidden), "gate_up")
        self.down_proj = self._param(torch.empty(num_experts, hidden, intermediate), "down")
        self.quant: Any = None
        self.fp4_quantizes_inputs = False
        self.checkpoint_prefix = "experts"  # our checkpoint name, set by fp4_take_over (for load errors)

    def _param(self, data: torch.Tensor, which: str, exact_dtype: bool = False, per_shard: bool = False
               ) -> nn.Parameter:
        param = nn.Parameter(data, requires_grad=False)
        param.shards = tuple(f"{e}.{p}" for e in range(self.num_experts) for p in ("gate", "up")) \
            if which == "gate_up" else tuple(str(e) for e in range(self.num_experts))
        param.weight_loader = self.weight_loader
        param.exact_dtype = exact_dtype
        param.per_shard = per_shard  # a global scale: one entry per shard ([E, 2] gate|up, [E, 1] down)
        return param

    # ------------------------------------------------------------------------------ FP4 packed experts
    def fp4_take_over(self, method: Any, name: str, is_targeted: Callable[[str], bool]) -> None:
        """Hold the experts packed in ``method``'s FP4 format if the checkpoint quantized them.

        ``name`` is this module's path (``model.layers.0.mlp.experts``); the checkpoint names its
        projections ``{name}.{e}.gate_proj`` etc. Quantized experts are all or none: a block the
        quantization_config ignores by name (as ``vtcore quantize`` lists experts it left dense), or
        whose every projection is ignored, stays dense; a mix is a CheckpointError.
        """
        if _ignored(name, getattr(method, "ignore", [])):
            return
        projs = [f"{name}.{e}.{p}_proj" for e in range(self.num_experts) for p in ("gate", "up", "down")]
        chosen = {n: bool(is_targeted(n)) for n in projs}
        if not any(chosen.values()):
            return
        if not all(chosen.values()):
            on, off = [n for n, c in chosen.items() if c], [n for n, c in chosen.items() if not c]
            raise CheckpointError(f"{name}: the quantization_config quantizes {_some(on)} but not {_some(off)}; "
                                  f"the experts of a layer must be quantized all or none")
        g = int(method.group_size)
        for proj, k in (("gate_proj/up_proj", self.hidden), ("down_proj", self.intermediate)):
            if k % g:
                raise CheckpointError(f"{name}: expert {proj} in_features={k} is not divisible by the "
                                      f"{method.format} group size {g}")
        device = self.gate_up_proj.device
        n_exp, hid, inter = self.num_experts, self.hidden, self.intermediate
        self.gate_up_proj = None
        self.down_proj = None
        for which, rows, k, n_global in (("gate_up", 2 * inter, hid, 2), ("down", hid, inter, 1)):
            setattr(self, f"{which}_weight_packed", self._param(
                torch.empty(n_exp, rows, k // 2, dtype=torch.uint8, device=device), which, exact_dtype=True))
            setattr(self, f"{which}_weight_scale", self._param(
                torch.empty(n_exp, rows, k // g, dtype=method.scale_dtype, device=device), which, exact_dtype=True))
            if method.has_global_scale:
                setattr(self, f"{which}_weight_global_scale", self._param(
                    torch.empty(n_exp, n_global, dtype=torch.float32, device=device), which, exact_dtype=True,
                    per_shard=True))
            if method.quantize_inputs and method.has_global_scale:  # NaN until loaded: see _input_scale_loader
                param = self._param(torch.full((n_exp, n_global), float("nan"), dtype=torch.float32, device=device),
                                    which, exact_dtype=True, per_shard=True)
                param.weight_loader = self._input_scale_loader
                setattr(self, f"{which}_input_global_scale", param)
        self.checkpoint_prefix = name
        self.fp4_quantizes_inputs = bool(method.quantize_inputs)
        self.quant = method

    def _input_scale_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard: str | None = None) -> None:
        """Load one expert projection's ``input_global_scale``; gate and up of an expert share one input,
        so a value differing from the other one already loaded is refused (naming both tensors)."""
        self.weight_loader(param, loaded, shard)
        if shard is None or param.shape[-1] != 2:
            return
        expert = int(shard.partition(".")[0])
        gate, up = param.data[expert].tolist()
        if gate == gate and up == up and gate != up:  # both loaded (not NaN) and different
            names = [f"{self.checkpoint_prefix}.{expert}.{p}_proj.input_global_scale" for p in ("gate", "up")]
            raise ValueError(f"value {float(loaded.reshape(-1)[0])!r} while {names[0]} = {gate!r} and "
                             f"{names[1]} = {up!r} differ: gate_proj and up_proj of an expert share one input, "
                             "so one input_global_scale is expected")

    def _quantize_input(self, x: torch.Tensor, which: str, e: int) -> torch.Tensor:
        """W4A4: expert ``e``'s input to its ``which`` matmul, fake-quantized (unchanged for A16)."""
        method = self.quant
        if not method.quantize_inputs:
            return x
        scale = getattr(self, f"{which}_input_global_scale")[e, :1] if method.has_global_scale else None
        return method.quantize_input(x, scale)  # gate_up: the gate's value (equal to up's, checked at load)

    def _fp4(self, x: torch.Tensor, which: str, e: int) -> torch.Tensor:
        """``x @ W_e.T`` for expert ``e``'s packed ``which`` ("gate_up" or "down") weight."""
        method = self.quant
        x = self._quantize_input(x, which, e)
        packed = getattr(self, f"{which}_weight_packed")[e]
        scale = getattr(self, f"{which}_weight_scale")[e]
        row_global = None
        if method.has_global_scale:
            pair = getattr(self, f"{which}_weight_global_scale")[e]  # [2] (gate, up) or [1] (down)
            row_global = pair.repeat_interleave(packed.shape[0] // pair.numel())
        if _fp4_kernel(x):
            from vtcore.kernels.fp4_gemm import fp4_matmul

            return fp4_matmul(x, packed, scale.view(torch.uint8), method.scale_kind, row_global, method.group_size)
        from vtcore.kernels.fp4 import fp4_linear_reference

        return fp4_linear_reference(x, packed, scale, method.scale_kind, row_global, method.group_size)

    @torch.no_grad()
    def _fp4_dummy_init(self, gen: torch.Generator) -> None:
        """Random codes; scales of the checkpoint's dtypes chosen so the weights' rms is about 1/sqrt(in),
        as ``FP4Method.dummy_init`` does for a Linear."""
        method = self.quant
        for which, k in (("gate_up", self.hidden), ("down", self.intermediate)):
            packed = getattr(self, f"{which}_weight_packed")
            scale_param = getattr(self, f"{which}_weight_scale")
            device = packed.device
            packed.copy_(torch.randint(0, 256, packed.shape, generator=gen, device=device,
                                       dtype=torch.int32).to(torch.uint8))
            scale = 1.0 / (2.93 * math.sqrt(k))  # e2m1 codes drawn uniformly have rms 2.93
            if method.has_global_scale:
                getattr(self, f"{which}_weight_global_scale").fill_(64.0)  # fp8 scales out of e4m3's subnormals
                if method.quantize_inputs:  # as calibrated for inputs of |x| <= 8 (as FP4Method.dummy_init)
                    getattr(self, f"{which}_input_global_scale").fill_(448.0 * 6.0 / 8.0)
                scale_param.copy_(torch.full(scale_param.shape, scale * 64.0, device=device).to(scale_param.dtype))
            else:
                scale_param.fill_(round(math.log2(scale)) + 127)

    # ------------------------------------------------------------------------------ loading
    def shard_view(self, param: nn.Parameter, shard: str | None) -> torch.Tensor:
        """Whole 3-D tensors (``shard=None``) or one expert's matrix (``"3.gate"``, ``"3.up"``, ``"3"``);
        for a global-scale parameter one expert's entry of the shard ([1])."""
        target = param.data
        if shard is not None:
            expert, _, part = shard.partition(".")
            if not 0 <= int(expert) < self.num_experts:
                raise ValueError(f"expert index {expert} outside num_experts={self.num_experts}")
            target = target[int(expert)]
            if part and getattr(param, "per_shard", False):
                target = target[0:1] if part == "gate" else target[1:2]
            elif part:
                target = target[:self.intermediate] if part == "gate" else target[self.intermediate:]
        return target

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard: str | None = None) -> None:
        target = self.shard_view(param, shard)
        if tuple(target.shape) != tuple(loaded.shape):
            raise ValueError(f"shape {tuple(loaded.shape)}, expected {tuple(target.shape)}")
        target.copy_(loaded)

    def dummy_init(self, gen: torch.Generator) -> None:
        if self.quant is not None:
            self._fp4_dummy_init(gen)
            return
        for p in (self.gate_up_proj, self.down_proj):
            p.copy_(torch.randn(p.shape, generator=gen, device=p.device) / math.sqrt(p.shape[-1]))

    def active_fraction(self, batch: int) -> float:
        """The share of the experts' weights a decode step of ``batch`` sequences is expected to read
        (uniform routing of ``top_k`` of ``num_experts``; the bench's roofline)."""
        return 1.0 - (1.0 - self.top_k / self.num_experts) ** batch

    @property
    def supports_decode_graphs(self) -> bool:
        """W4A4 experts run the per-expert loop, which reads the selected ids on the host."""
        return not self.fp4_quantizes_inputs

    def fused(self, x: torch.Tensor) -> bool:
        """Whether :meth:`forward` runs the Triton fused MoE (CUDA; not W4A4, whose inputs are
        fake-quantized per expert)."""
        return x.is_cuda and not self.fp4_quantizes_inputs

    def forward(self, x: torch.Tensor, experts: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """``sum_j weights[:, j] * mlp_{experts[:, j]}(x)``: on CUDA the grouped Triton kernels
        (no host sync, so decode can be graphed); elsewhere a loop over the selected experts."""
        if self.fused(x):
            from vtcore.kernels.fused_moe import FP4Experts, fused_experts
            fp4 = None
            if self.quant is not None:
                m = self.quant
                glob = (self.gate_up_weight_global_scale, self.down_weight_global_scale) if m.has_global_scale \
                    else (None, None)
                fp4 = FP4Experts(self.gate_up_weight_packed, self.gate_up_weight_scale, self.down_weight_packed,
                                 self.down_weight_scale, m.scale_kind, int(m.group_size), *glob)
            return fused_experts(x, experts, weights, self.gate_up_proj, self.down_proj, fp4=fp4)
        out = torch.zeros_like(x)
        quant = self.quant is not None
        for e in experts.unique().tolist():
            token, slot = torch.where(experts == e)
            xs = x[token]
            gate_up = self._fp4(xs, "gate_up", e) if quant else F.linear(xs, self.gate_up_proj[e])
            h = silu_and_mul(gate_up)
            down = self._fp4(h, "down", e) if quant else F.linear(h, self.down_proj[e])
            out.index_add_(0, token, down * weights[token, slot, None])
        return out


def _fp4_kernel(x: torch.Tensor) -> bool:
    """Packed experts run the Triton FP4 kernel on CUDA and the float32 torch reference elsewhere
    (a test may point this at the kernel under TRITON_INTERPRET on CPU)."""
    return x.is_cuda


def _ignored(name: str, ignore: list[str]) -> bool:
    """``name`` is listed in a quantization_config ``ignore`` (exactly or by a ``re:`` regex)."""
    return any(re.match(p[3:], name) if p.startswith("re:") else p == name for p in ignore)


def _some(names: list[str], shown: int = 6) -> str:
    return repr(names) if len(names) <= shown else f"{names[:shown]!r} and {len(names) - shown} more"


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
