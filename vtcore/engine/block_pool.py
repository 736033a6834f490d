"""The KV block pool: fixed-size blocks handed to requests on demand and returned on finish or preemption."""
from __future__ import annotations

from collections import deque


class BlockPool:
    """Free-list allocator over ``num_blocks`` KV blocks of ``block_size`` tokens each."""

    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._free: deque[int] = deque(range(num_blocks))

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def usage(self) -> float:
        return 1.0 - len(self._free) / self.num_blocks

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def grow(self, block_ids: list[int], num_tokens: int) -> bool:
        """Extend ``block_ids`` in place to hold ``num_tokens`` tokens; False (no change) if the pool is short."""
        need = self.blocks_needed(num_tokens) - len(block_ids)
        if need > len(self._free):
            return False
        block_ids.extend(self._free.popleft() for _ in range(max(need, 0)))
        return True

    def free(self, block_ids: list[int]) -> None:
        """Return blocks to the pool. Safe to reuse at once: all device work is ordered on one stream."""
        self._free.extend(block_ids)
        block_ids.clear()
