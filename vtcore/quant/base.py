"""What a quant-method plugin provides, registered by compressed-tensors format name.

The model builder finds ``quantization_config.format`` in config.json, resolves the class a plugin
registered for it (``vtcore_quant_methods``) and, before any weights load, lets it take over the
model's quantizable layers (:func:`vtcore.layers.quantized.take_over`). A layer that holds dense
weights a method may replace (``Linear``, the MoE ``Experts``) describes each of them as a
:class:`WeightSpec` and names the checkpoint modules behind it. Where the method :meth:`quantizes
<QuantMethod.quantizes>` them, the layer drops the dense parameter and registers the tensors of
:meth:`~QuantMethod.create_weights` in its place, loads them through its own loaders, initialises
them through :meth:`~QuantMethod.dummy_init` for ``load_format="dummy"``, and computes through
:meth:`~QuantMethod.apply` (or the fast paths :meth:`~QuantMethod.gemv_weight` and
:meth:`~QuantMethod.experts_operand`, where the method offers them). A method sees only specs and
:class:`QuantWeights`, never a layer class, so one method serves every layer kind.
"""
from __future__ import annotations

import abc
from typing import Any

import attrs
import torch
from torch import nn


@attrs.frozen
class WeightSpec:
    """One dense weight, ``[*lead, rows, in_features]``: its rows split into checkpoint shards (q/k/v,
    gate/up; ``((None, rows),)`` when unsharded), ``lead`` a stack of independent matrices (the
    experts: ``(num_experts,)``). ``name`` says where it is, for error messages."""

    name: str
    in_features: int
    shards: tuple[tuple[str | None, int], ...]
    lead: tuple[int, ...] = ()

    @property
    def rows(self) -> int:
        return sum(n for _, n in self.shards)

    @property
    def matrix(self) -> "WeightSpec":
        """One matrix of the stack."""
        return attrs.evolve(self, lead=())


@attrs.frozen
class QuantTensor:
    """A tensor a method holds for one weight: its (empty) data, in the dtype the checkpoint must
    carry it in exactly. ``per_shard``: the last axis has one entry per shard (a shard's tensor
    loads into its entry). ``shared``: the shards of one matrix see one input, so they must load
    one value (a differing one is refused at load); unloaded entries hold NaN."""

    data: torch.Tensor
    per_shard: bool = False
    shared: bool = False


class QuantWeights:
    """The tensors of one quantized weight, by the names ``create_weights`` gave them, as the layer
    holds them (``module.<prefix><name>``); :meth:`select` views matrix ``i`` of a stack.
    ``cache`` is the method's, for operands derived from the tensors; a load through the layer's
    loaders empties it (:meth:`invalidate`)."""

    def __init__(self, spec: WeightSpec, module: nn.Module, prefix: str, index: int | None = None) -> None:
        self.spec, self.module, self.prefix, self.index = spec, module, prefix, index
        self.cache: dict[str, Any] = {}

    def get(self, name: str) -> torch.Tensor | None:
        tensor = getattr(self.module, self.prefix + name, None)
        return tensor if tensor is None or self.index is None else tensor[self.index]

    def __getitem__(self, name: str) -> torch.Tensor:
        tensor = self.get(name)
        if tensor is None:
            raise KeyError(f"{self.spec.name}: no quantized tensor {self.prefix + name!r}")
        return tensor

    def select(self, index: int) -> "QuantWeights":
        if self.index is not None or not self.spec.lead:
            raise ValueError(f"{self.spec.name}: select({index}) needs a stack of matrices")
        return QuantWeights(self.spec.matrix, self.module, self.prefix, index)

    def invalidate(self) -> None:
        self.cache.clear()


class QuantMethod(abc.ABC):
    """A quantization method for one ``quantization_config``."""

    def __init__(self, quant_config: dict[str, Any]) -> None:
        self.quant_config = quant_config

    @abc.abstractmethod
    def quantizes(self, module: str) -> bool:
        """Whether the checkpoint holds module ``module`` (a checkpoint name such as
        ``model.layers.0.self_attn.q_proj`` or ``model.layers.0.mlp.experts.3.down_proj``) quantized."""

    @abc.abstractmethod
    def create_weights(self, spec: WeightSpec, device: torch.device) -> dict[str, QuantTensor]:
        """The tensors that hold ``spec``'s weight in this format, by checkpoint suffix
        (``weight_packed``, ...); shaped ``[*spec.lead, ...]``. A spec the format cannot hold (an
        in_features not divisible by its group size, say) raises ``CheckpointError`` naming it."""

    @abc.abstractmethod
    def dummy_init(self, weights: QuantWeights, gen: torch.Generator) -> None:
        """Fill ``weights`` with random values from ``gen`` of a trained model's scale (rms about
        1/sqrt(in_features))."""

    @abc.abstractmethod
    def apply(self, weights: QuantWeights, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """``x @ W.T (+ bias)`` for one matrix (a weight of no stack, or a :meth:`QuantWeights.select`)."""

    def gemv_weight(self, weights: QuantWeights) -> object | None:
        """The operand :func:`vtcore.kernels.gemv.gemv` takes for the weight at decode sizes (e.g. a
        :class:`~vtcore.kernels.fp4.FP4Weight`), or None to run ``apply`` instead."""
        return None

    def experts_operand(self, gate_up: QuantWeights, down: QuantWeights) -> object | None:
        """The quantized operand of :func:`vtcore.kernels.fused_moe.fused_experts` for stacked expert
        weights (e.g. :class:`~vtcore.kernels.fused_moe.FP4Experts`), or None: the layer loops over
        the experts through ``apply``."""
        return None
