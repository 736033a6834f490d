"""The state snapshot pool: prefix caching for families with per-request state (hybrid models).

A cached prefix of a hybrid family needs, besides its KV blocks, every stateful layer's state at the
prefix's end. The runner keeps ``num_slots`` snapshot slots beside the running requests' state slots.
While a request computes, the scheduler asks for a slot at each multiple of ``interval`` tokens it
crosses (:meth:`take`); the step writes the state there; once the blocks up to that point are
registered in the block pool, the snapshot is registered under the hash of the prefix's last block
(:meth:`register`), so a request that matches the prefix resumes from it (:meth:`find`). Registered
snapshots are evicted least recently used first; a taken slot whose request leaves before registering
it is handed back (:meth:`release`). Reusing a slot at once is safe for the same reason as a KV
block's: all device work is ordered on one stream, and a step copies its restores before any write.
"""
from __future__ import annotations

from collections import OrderedDict

from vtcore.engine.block_pool import BlockHash


class SnapshotPool:
    """``num_slots`` state snapshots, one per block-aligned prefix end every ``interval`` tokens."""

    def __init__(self, num_slots: int, interval: int) -> None:
        self.num_slots = num_slots
        self.interval = interval
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_slots))  # hand-out order
        self._cached: dict[BlockHash, int] = {}
        self._hash_of: dict[int, BlockHash] = {}

    @property
    def num_free(self) -> int:
        return len(self._free)

    def take(self) -> int | None:
        """A slot for a snapshot about to be written (the least recently used one), or None when every
        slot waits for its registration."""
        if not self._free:
            return None
        slot, _ = self._free.popitem(last=False)
        old = self._hash_of.pop(slot, None)
        if old is not None:
            del self._cached[old]
        return slot

    def register(self, slot: int, prefix_hash: BlockHash) -> None:
        """Make the snapshot in ``slot`` findable by the hash of its prefix's last block (a duplicate of a
        snapshot already cached is handed back instead)."""
        if prefix_hash in self._cached:
            self.release(slot)
            return
        self._cached[prefix_hash] = slot
        self._hash_of[slot] = prefix_hash
        self._free[slot] = None  # evictable, most recently used

    def release(self, slot: int) -> None:
        """Hand back a taken slot that was never registered: reused first."""
        self._free[slot] = None
        self._free.move_to_end(slot, last=False)

    def find(self, prefix_hash: BlockHash) -> int | None:
        """The slot holding the state at the end of the prefix hashed ``prefix_hash`` (now most recently used)."""
        slot = self._cached.get(prefix_hash)
        if slot is not None:
            self._free.move_to_end(slot)
        return slot

    def reset(self) -> None:
        """Forget every registered snapshot (taken slots stay taken)."""
        for slot in self._hash_of:
            self._free.move_to_end(slot, last=False)
        self._cached.clear()
        self._hash_of.clear()
