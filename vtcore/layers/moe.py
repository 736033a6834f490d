"""Mixture-of-experts weights: ``Experts``, the stacked expert MLPs that ``kernels.fused_moe`` runs.

Dense, the experts are 3-D tensors (``gate_up_proj`` [E, 2I, H] gate|up, ``down_proj`` [E, H, I]),
loadable fused (``experts.gate_up_proj``) or per expert (shards ``"3.gate"``, ``"3.up"``, ``"3"``:
a family's ``checkpoint_name`` routes ``experts.3.gate_proj.weight`` there). Under a quant method
(:mod:`vtcore.layers.quantized`) each stack is held in the method's format instead, its tensors
named ``gate_up_<name>`` / ``down_<name>`` (``gate_up_weight_packed`` [E, 2I, H/2], ...) and loaded
per expert from ``experts.{e}.{gate,up,down}_proj.<name>``; the layer's checkpoint modules are
``{path}.{e}.{gate,up,down}_proj``, quantized all or none.
"""
from __future__ import annotations

import math

import torch
from torch import nn
from torch.nn import functional as F

from vtcore.layers import parallel as tp
from vtcore.layers.activation import silu_and_mul
from vtcore.layers.linear import copy_checked, loadable_param
from vtcore.layers.quantized import QuantSlot, QuantTarget
from vtcore.quant.base import QuantTensor, WeightSpec


class Experts(nn.Module, QuantTarget):
    """Stacked expert MLPs: ``sum_j weights[:, j] * mlp_{experts[:, j]}(x)`` for the routed ``experts``.

    Under tensor parallelism (:mod:`vtcore.layers.parallel`) every rank holds every expert, split along
    its intermediate size (its rows of gate and of up, its columns of down), and sums its partial output
    over the ranks."""

    tp_sharded = True

    def __init__(self, num_experts: int, hidden: int, intermediate: int, top_k: int = 1) -> None:
        super().__init__()
        intermediate = tp.split(intermediate, "the experts' intermediate size")
        self.tp_group = tp.tp()
        self.num_experts, self.hidden, self.intermediate = num_experts, hidden, intermediate
        self.top_k = top_k  # experts a token uses (for active_fraction)
        self.gate_up_proj = self._param(torch.empty(num_experts, 2 * intermediate, hidden), "gate_up_proj")
        self.down_proj = self._param(torch.empty(num_experts, hidden, intermediate), "down_proj")
        self.quant = None
        self._fused: tuple[object, object | None] | None = None  # (method, its operand)

    def _param(self, data: torch.Tensor, dense: str, exact_dtype: bool = False, per_shard: bool = False
               ) -> nn.Parameter:
        """Loaded per expert (and gate/up); ``per_shard``: one entry per shard ([E, 2] gate|up, [E, 1] down)."""
        shards = tuple(f"{e}.{p}" for e in range(self.num_experts) for p in ("gate", "up")) \
            if dense == "gate_up_proj" else tuple(str(e) for e in range(self.num_experts))
        param = loadable_param(data, shards, self.weight_loader, per_shard, exact_dtype)
        param.down = dense == "down_proj"  # (a quant method's tensors replace the dense two: which one it holds)
        return param

    # ------------------------------------------------------------------------------ quantization
    def quant_slots(self, name: str, model: nn.Module) -> list[QuantSlot]:
        e, h, i = self.num_experts, self.hidden, self.intermediate
        return [
            QuantSlot("gate_up_proj", "gate_up_", WeightSpec(f"{name}: expert gate_proj/up_proj", h,
                                                             (("gate", i), ("up", i)), (e,)),
                      tuple(f"{name}.{x}.{p}_proj" for x in range(e) for p in ("gate", "up"))),
            QuantSlot("down_proj", "down_", WeightSpec(f"{name}: expert down_proj", i, ((None, h),), (e,)),
                      tuple(f"{name}.{x}.down_proj" for x in range(e))),
        ]

    def quant_param(self, slot: QuantSlot, tensor: QuantTensor) -> nn.Parameter:
        return self._param(tensor.data, slot.dense, exact_dtype=True, per_shard=tensor.per_shard)

    # ------------------------------------------------------------------------------ loading
    def shard_view(self, param: nn.Parameter, shard: str | None) -> torch.Tensor:
        """Whole 3-D tensors (``shard=None``) or one expert's matrix (``"3.gate"``, ``"3.up"``, ``"3"``);
        for a per-shard parameter one expert's entry of the shard ([1])."""
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
        copy_checked(self.shard_view(param, shard), self._rank_part(param, loaded, shard))

    def _rank_part(self, param: nn.Parameter, loaded: torch.Tensor, shard: str | None) -> torch.Tensor:
        """The rank's intermediate rows (gate, up) or columns (down) of a whole expert tensor (packed FP4
        codes and group scales alike); a per-shard tensor (a global scale) and a per-row vector of down
        (its rows are the hidden size, whole on every rank) whole."""
        experts = 1 if shard is None else 0  # leading dimensions: [E, ...] for all experts at once
        if getattr(param, "per_shard", False) or (param.down and loaded.dim() < 2 + experts):
            return loaded
        if param.down:  # [(E,) H, I]
            return tp.rank_part(loaded, 1 + experts, self.tp_group)
        if shard is None:  # [E, 2I, ...] gate|up
            whole = loaded.shape[1] // 2
            return tp.rank_part(loaded, 1, self.tp_group, [whole, whole])
        return tp.rank_part(loaded, 0, self.tp_group)  # one expert's gate or up rows

    def dummy_init(self, gen: torch.Generator) -> None:
        if self.quant is not None:
            self.quant_dummy_init(gen)
            return
        for p in (self.gate_up_proj, self.down_proj):
            p.copy_(torch.randn(p.shape, generator=gen, device=p.device) / math.sqrt(p.shape[-1]))

    # ------------------------------------------------------------------------------ compute
    def active_fraction(self, batch: int) -> float:
        """The share of the experts' weights a decode step of ``batch`` sequences is expected to read
        (uniform routing of ``top_k`` of ``num_experts``; the bench's roofline)."""
        return 1.0 - (1.0 - self.top_k / self.num_experts) ** batch

    def _operand(self) -> object | None:
        """The method's fused-MoE operand, built once per method: it holds the parameters themselves,
        which loads and ``Module.to`` update in place."""
        if self._fused is None or self._fused[0] is not self.quant:
            w = self.quant_weights
            self._fused = (self.quant, self.quant.experts_operand(w["gate_up_proj"], w["down_proj"]))
        return self._fused[1]

    @property
    def supports_decode_graphs(self) -> bool:
        """Experts the fused kernels cannot run (a method with no ``experts_operand``, e.g. W4A4) take
        the per-expert loop, which reads the selected ids on the host."""
        return self.quant is None or self._operand() is not None

    def fused(self, x: torch.Tensor) -> bool:
        """Whether :meth:`forward` runs the Triton fused MoE (CUDA, and a dense or fusable quantized stack)."""
        return x.is_cuda and self.supports_decode_graphs

    def forward(self, x: torch.Tensor, experts: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """``sum_j weights[:, j] * mlp_{experts[:, j]}(x)``: on CUDA the grouped Triton kernels
        (no host sync, so decode can be graphed); elsewhere a loop over the selected experts."""
        if self.fused(x):
            from vtcore.kernels.fused_moe import fused_experts
            fp4 = None if self.quant is None else self._operand()
            return tp.all_reduce(fused_experts(x, experts, weights, self.gate_up_proj, self.down_proj, fp4=fp4),
                                 self.tp_group)
        out = torch.zeros_like(x)
        for e in experts.unique().tolist():
            token, slot = torch.where(experts == e)
            h = silu_and_mul(self._project(x[token], "gate_up_proj", e))
            out.index_add_(0, token, self._project(h, "down_proj", e) * weights[token, slot, None])
        return tp.all_reduce(out, self.tp_group)

    def _project(self, x: torch.Tensor, dense: str, e: int) -> torch.Tensor:
        if self.quant is None:
            return F.linear(x, getattr(self, dense)[e])
        return self.quant.apply(self.quant_weights[dense].select(e), x)
