"""Layers whose dense weights a quant method may take over (:class:`QuantTarget`), and the take-over.

A layer lists its quantizable weights as :class:`QuantSlot` s: the dense parameter, the prefix its
quantized tensors get, the :class:`~vtcore.quant.base.WeightSpec`, and the checkpoint modules behind
it, one per (matrix, shard) in row-major order. :func:`take_over` asks the method which of those
modules the checkpoint quantized: all of a layer's or none (a mix is a ``CheckpointError``). A taken
layer drops its dense parameters, registers the method's tensors as parameters loaded by its own
``weight_loader`` (a load empties the weight's cached operands, and a ``shared`` tensor must load one
value per matrix), and keeps one :class:`~vtcore.quant.base.QuantWeights` per slot in
``quant_weights``; ``quant`` is the method.
"""
from __future__ import annotations

import abc
from typing import Callable

import attrs
import torch
from torch import nn

from vtcore.errors import CheckpointError
from vtcore.layers import parallel as tp
from vtcore.quant.base import QuantMethod, QuantTensor, QuantWeights, WeightSpec

Loader = Callable[[nn.Parameter, torch.Tensor, "str | None"], None]


@attrs.frozen
class QuantSlot:
    """One quantizable weight of a layer."""

    dense: str  # the dense parameter it replaces ("weight", "gate_up_proj")
    prefix: str  # the method's tensors are registered as ``prefix + name`` ("", "gate_up_")
    spec: WeightSpec
    modules: tuple[str, ...]  # checkpoint module per (matrix, shard), row-major


class QuantTarget(abc.ABC):
    """Mixin of an ``nn.Module`` whose dense weights a quant method may take over."""

    quant: QuantMethod | None = None
    quant_weights: dict[str, QuantWeights]

    @abc.abstractmethod
    def quant_slots(self, name: str, model: nn.Module) -> list[QuantSlot]:
        """The layer's quantizable weights; ``name`` is its path in ``model``."""

    @abc.abstractmethod
    def quant_param(self, slot: QuantSlot, tensor: QuantTensor) -> nn.Parameter:
        """A parameter of ``slot``'s weight holding ``tensor``, loaded by the layer's shard rules."""

    def quant_dummy_init(self, gen: torch.Generator) -> None:
        """Random quantized weights (``load_format="dummy"``), slot by slot."""
        for weights in self.quant_weights.values():
            self.quant.dummy_init(weights, gen)


def take_over(model: nn.Module, method: QuantMethod) -> None:
    """Hand every layer of ``model`` whose checkpoint modules ``method`` quantizes over to it."""
    for name, module in list(model.named_modules()):
        if not isinstance(module, QuantTarget):
            continue
        slots = module.quant_slots(name, model)
        chosen = {m: method.quantizes(m) for slot in slots for m in slot.modules}
        if not any(chosen.values()):
            continue
        if not all(chosen.values()):
            on, off = [m for m, c in chosen.items() if c], [m for m, c in chosen.items() if not c]
            raise CheckpointError(f"{name}: the quantization_config quantizes {_some(on)} but not {_some(off)}; "
                                  "the weights of one layer must be quantized all or none")
        created = [(slot, _create(method, slot, getattr(module, slot.dense).device)) for slot in slots]
        module.quant_weights = {}
        for slot, tensors in created:
            setattr(module, slot.dense, None)
            weights = QuantWeights(slot.spec, module, slot.prefix)
            for key, tensor in tensors.items():
                param = module.quant_param(slot, tensor)
                param.weight_loader = _loader(param.weight_loader, weights, slot, key, tensor.shared)
                setattr(module, slot.prefix + key, param)
            module.quant_weights[slot.dense] = weights
        module.quant = method


def _create(method: QuantMethod, slot: QuantSlot, device: torch.device) -> dict[str, QuantTensor]:
    """The method's tensors for ``slot``; a spec it refuses at a tensor-parallel size above 1 is this rank's
    part, which the error says."""
    try:
        return method.create_weights(slot.spec, device)
    except CheckpointError as exc:
        size = tp.tp().size
        if size == 1:
            raise
        raise CheckpointError(f"{exc} (this rank's part at tensor_parallel_size={size}: serve it on fewer ranks)"
                              ) from None


def _loader(load: Loader, weights: QuantWeights, slot: QuantSlot, key: str, shared: bool) -> Loader:
    """``load``, then drop the weight's cached operands (the loader writes through ``param.data``,
    which leaves the parameter's version unchanged); for a ``shared`` tensor, refuse a value that
    differs from another shard of the same matrix."""
    def loader(param: nn.Parameter, loaded: torch.Tensor, shard: str | None = None) -> None:
        load(param, loaded, shard)
        weights.invalidate()
        if shared:  # (what the loader wrote: ``loaded`` may be a lazy slice of the file)
            _check_shared(param.data, slot, key)
    return loader


def _check_shared(data: torch.Tensor, slot: QuantSlot, key: str) -> None:
    for m, row in enumerate(data.reshape(-1, data.shape[-1]).tolist()):
        loaded = {slot.modules[m * len(row) + j]: v for j, v in enumerate(row) if v == v}  # NaN: not loaded
        if len(set(loaded.values())) > 1:
            shown = " and ".join(f"{module}.{key} = {v!r}" for module, v in loaded.items())
            raise ValueError(f"a value its shards disagree on ({shown} differ); the shards of one matrix see one "
                             f"input, so one {key} is expected")


def _some(names: list[str], shown: int = 6) -> str:
    return repr(names) if len(names) <= shown else f"{names[:shown]!r} and {len(names) - shown} more"
