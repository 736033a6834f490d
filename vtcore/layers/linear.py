"""Linear layers whose weights may be fused from several checkpoint tensors (q/k/v, gate/up).

A fused layer names its shards (``("q", 2048), ("k", 512), ("v", 512)``); the loader calls
``weight_loader(param, tensor, shard)`` once per checkpoint tensor and each shard lands in its
row slice. The loader uses ``param.shards`` to check that every shard arrived.
"""
from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F


class Linear(nn.Module):
    """``y = x W^T (+ b)`` with an optional split of the output rows into named shards."""

    def __init__(self, in_features: int, out_features: int | list[tuple[str, int]], bias: bool = False) -> None:
        super().__init__()
        shards = out_features if isinstance(out_features, list) else []
        self.in_features = in_features
        self.out_features = sum(n for _, n in shards) if shards else int(out_features)
        self.shard_slices: dict[str, slice] = {}
        start = 0
        for name, size in shards:
            self.shard_slices[name] = slice(start, start + size)
            start += size
        self.weight = self._param(torch.empty(self.out_features, in_features))
        self.bias = self._param(torch.empty(self.out_features)) if bias else None

    def _param(self, data: torch.Tensor) -> nn.Parameter:
        param = nn.Parameter(data, requires_grad=False)
        param.shards = tuple(self.shard_slices) or (None,)
        param.weight_loader = self.weight_loader
        return param

    def shard_view(self, param: nn.Parameter, shard: str | None) -> torch.Tensor:
        """The part of ``param`` that checkpoint shard ``shard`` fills (all of it for None)."""
        return param.data if shard is None else param.data[self.shard_slices[shard]]

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard: str | None = None) -> None:
        """Copy one checkpoint tensor into ``param`` (its shard's rows when ``shard`` is given)."""
        target = self.shard_view(param, shard)
        if tuple(target.shape) != tuple(loaded.shape):
            raise ValueError(f"shape {tuple(loaded.shape)}, expected {tuple(target.shape)}")
        target.copy_(loaded)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)
