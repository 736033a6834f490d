"""A checkpoint tensor read only where it is used: tensor parallelism's ranks keep a part of each tensor.

``LazySlice`` stands for one safetensors tensor (``safe_open(...).get_slice(name)``). Narrowing or
splitting it selects rows, columns or blocks without reading anything; ``materialize()`` reads just the
selected elements from the memory-mapped file (in the dtype asked for with ``to``). Weight loaders treat
it as a tensor through ``narrow``, ``split``, ``shape`` and ``dim`` and materialize it before they copy
(``vtcore.layers.parallel.materialize``: ``copy_checked`` and ``rank_part`` call it).
"""
from __future__ import annotations

from typing import Any

import torch


class LazySlice:
    def __init__(self, source: Any, index: tuple[slice, ...] | None = None, dtype: torch.dtype | None = None
                 ) -> None:
        self.source, self.dtype = source, dtype
        whole = tuple(source.get_shape())
        self.index = index or tuple(slice(0, n) for n in whole)
        self.shape = torch.Size(s.stop - s.start for s in self.index)

    def dim(self) -> int:
        return len(self.shape)

    def to(self, dtype: torch.dtype) -> "LazySlice":
        return LazySlice(self.source, self.index, dtype)

    def narrow(self, dim: int, start: int, length: int) -> "LazySlice":
        if not 0 <= start <= start + length <= self.shape[dim]:
            raise ValueError(f"shape {tuple(self.shape)}: no {length} elements from {start} along dimension {dim}")
        index = list(self.index)
        index[dim] = slice(index[dim].start + start, index[dim].start + start + length)
        return LazySlice(self.source, tuple(index), self.dtype)

    def split(self, sizes: list[int], dim: int = 0) -> list["LazySlice"]:
        if sum(sizes) != self.shape[dim]:
            raise ValueError(f"shape {tuple(self.shape)}, expected {sum(sizes)} along dimension {dim}")
        starts = [sum(sizes[:i]) for i in range(len(sizes))]
        return [self.narrow(dim, a, n) for a, n in zip(starts, sizes)]

    def materialize(self) -> torch.Tensor:
        """Read the selected elements (only those) from the file."""
        data = self.source[self.index] if self.index else self.source[:]
        return data if self.dtype is None else data.to(self.dtype)
