"""What a quant-method plugin provides, registered by compressed-tensors format name.

The model builder finds ``quantization_config.format`` in config.json, resolves the class a
plugin registered for it (``vtcore_quant_methods``), and calls ``prepare`` on the freshly built
model before any weights load: the method replaces the parameters of the Linears it targets with
its packed ones and their weight loaders, and their forward with its kernel.
"""
from __future__ import annotations

import abc
from typing import Any

from torch import nn


class QuantMethod(abc.ABC):
    """A quantization method for one ``quantization_config``."""

    def __init__(self, quant_config: dict[str, Any]) -> None:
        self.quant_config = quant_config

    @abc.abstractmethod
    def prepare(self, model: nn.Module) -> None:
        """Swap the targeted Linears of ``model`` to this method's packed weights and kernel."""

    def gemv_weight(self, layer: nn.Module) -> object | None:
        """The operand :func:`vtcore.kernels.gemv.gemv` takes for ``layer``'s weight at decode sizes
        (e.g. a :class:`~vtcore.kernels.fp4.FP4Weight`), or None to run ``apply`` instead."""
        return None
