"""Fixture plugin: an NVFP4 method that reads the two codes of a byte in the wrong order."""
from __future__ import annotations

import torch

from vtcore import hookimpl
from vtcore_quant_nvfp4.method import NVFP4Method


def _swap(packed: torch.Tensor) -> torch.Tensor:
    return ((packed & 0x0F) << 4) | (packed >> 4)


class SwappedNibbles(NVFP4Method):
    def decode_weight(self, tensors: dict[str, torch.Tensor]) -> torch.Tensor:
        return super().decode_weight({**tensors, "weight_packed": _swap(tensors["weight_packed"])})

    def apply(self, weights, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        param = getattr(weights.module, weights.prefix + "weight_packed")
        packed = param.data
        param.data = _swap(packed)
        try:
            return super().apply(weights, x, bias)
        finally:
            param.data = packed


@hookimpl
def vtcore_quant_methods() -> dict[str, str]:
    return {"nvfp4-pack-quantized": "tests.fixture_async.quant:SwappedNibbles"}
