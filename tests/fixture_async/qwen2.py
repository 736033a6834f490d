"""Fixture: the Qwen2 example with q/k/v biases that are loaded but never added.

Right only while the biases are at their init (0); imported lazily, when the family is built.
"""
from __future__ import annotations

import torch
from torch.nn import functional as F

from vtcore.family import ConformanceExample
from vtcore.layers.linear import Linear
from vtcore_qwen2.model import Qwen2ForCausalLM
from vtcore_qwen2.plugin import conformance_example


class _BiaslessLinear(Linear):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight)


class DroppedBias(Qwen2ForCausalLM):
    def __init__(self, config, max_position: int) -> None:
        super().__init__(config, max_position)
        for layer in self.model.layers:
            layer.self_attn.qkv_proj.__class__ = _BiaslessLinear


def dropped_bias_example() -> ConformanceExample:
    base = conformance_example()
    return ConformanceExample(hf_config={**base.hf_config, "architectures": ["DroppedBiasForCausalLM"]},
                              oracle=base.oracle)
