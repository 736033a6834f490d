"""The KV block pool: fixed-size blocks handed to requests on demand and returned on finish or preemption,
and the prefix cache over them.

Prefix caching (``enable_prefix_caching``): a full block whose KV is computed gets a hash that chains
its parent block's hash, its token ids and the pool's ``salt`` (what else changes the KV: the model's
dtype, its quant method), and is looked up by it. A request admitted with nothing computed reuses the
longest chain of cached blocks that matches its tokens (:meth:`BlockPool.match`); blocks are reference
counted, and a freed block keeps its hash and stays reusable until it is handed out again, least
recently freed first (a request's blocks are freed last-block-first, so a prefix outlives its tails).
Free blocks without a hash are handed out before cached ones, the most recently freed first, from a stack
that a request's new blocks leave in one slice.
"""
from __future__ import annotations

import functools
import hashlib
import struct
from collections import OrderedDict
from typing import Sequence

BlockHash = bytes
#: blocks whose token ids a lookup's ``BlockPool.hashes`` packs, and whose hashes it may find, at once
_PIECE = 8


def _sha256(data: bytes) -> BlockHash:
    return hashlib.sha256(data).digest()


class BlockPool:
    """Reference-counted allocator over ``num_blocks`` KV blocks of ``block_size`` tokens each, with a
    prefix cache of full blocks when ``caching``."""

    def __init__(self, num_blocks: int, block_size: int, caching: bool = False, salt: bytes = b"") -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.caching = caching
        self.salt = salt
        self._plain = list(range(num_blocks - 1, -1, -1))  # free, no hash: handed out from the end
        self._lru: OrderedDict[int, None] = OrderedDict()  # free, cached: least recently freed first
        self._refs = [0] * num_blocks
        self._cached: dict[BlockHash, int] = {}
        self._hash_of: dict[int, BlockHash] = {}
        self.queries = self.hits = 0  # prompt tokens looked up, and found, by ``match``
        # a block's digest by its input (parent hash and token bytes), about as many as the pool caches: a prefix
        # hit's lookup re-hashes every cached block of its prefix, and finds them here instead of in sha256
        self._digest = functools.lru_cache(maxsize=max(num_blocks, 1))(_sha256)
        # a whole lookup piece's hashes by its parent hash and token bytes, least recently used first: a hit's
        # lookup of a long prefix takes _PIECE hashes a step (the same memory a block as the digests' memo)
        self._pieces: OrderedDict[tuple[BlockHash, bytes], tuple[BlockHash, ...]] = OrderedDict()
        self._max_pieces = max(num_blocks // _PIECE, 1)

    @property
    def num_free(self) -> int:
        return len(self._plain) + len(self._lru)

    @property
    def usage(self) -> float:
        return 1.0 - self.num_free / self.num_blocks

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def grow(self, block_ids: list[int], num_tokens: int) -> bool:
        """Extend ``block_ids`` in place to hold ``num_tokens`` tokens; False (no change) if the pool is short."""
        need = -(-num_tokens // self.block_size) - len(block_ids)
        if need <= 0:
            return True  # (most calls: a decoding request's last block has room)
        if need > self.num_free:
            return False
        plain = min(need, len(self._plain))
        if plain:
            taken = self._plain[-plain:]
            del self._plain[-plain:]
            taken.reverse()
            block_ids += taken
        for _ in range(need - plain):
            block, _ = self._lru.popitem(last=False)
            del self._cached[self._hash_of.pop(block)]  # evicted: its content is overwritten
            block_ids.append(block)
        for block in block_ids[-need:]:
            self._refs[block] = 1
        return True

    def free(self, block_ids: list[int]) -> None:
        """Drop one reference to each block; an unreferenced block is free again (a cached one keeps its
        hash until handed out). Safe to reuse at once: all device work is ordered on one stream."""
        for block in reversed(block_ids):
            self._refs[block] -= 1
            if self._refs[block] == 0:
                if block in self._hash_of:
                    self._lru[block] = None
                else:
                    self._plain.append(block)  # nothing to keep: handed out first
        block_ids.clear()

    def hashes(self, tokens: Sequence[int], known: list[BlockHash], num_blocks: int,
               cache_salt: str | None = None, until_uncached: bool = False) -> list[BlockHash]:
        """``known`` (the hashes of the first blocks of ``tokens``) extended in place to ``num_blocks``.
        ``cache_salt`` (a request's, vLLM's): its blocks chain from a root of their own, so only requests
        with the same salt share them. ``until_uncached``: stop after the first new hash that no cached block
        has (a lookup needs no more; the rest are made when the blocks are registered, once the step is on
        the device, which need not wait for them)."""
        bs, start = self.block_size, len(known)
        parent = known[-1] if known else self.root(cache_salt)
        # a block's hash: sha256 of its parent's hash (the root for the first block) and its int64 token ids,
        # packed at once, or for a lookup, which may stop early, _PIECE blocks at a time: a whole piece found
        # before, by its parent and its ids, gives its hashes at once (a hit's lookup of a long prefix)
        piece = _PIECE if until_uncached else max(num_blocks - start, 1)
        for first in range(start, num_blocks, piece):
            last = min(first + piece, num_blocks)
            key = (parent, struct.pack(f"{(last - first) * bs}q", *tokens[first * bs:last * bs]))
            chain = self._pieces.get(key) if until_uncached else None
            if chain is not None:
                self._pieces.move_to_end(key)
                known += chain
                parent = chain[-1]
                if parent not in self._cached:
                    return known
                continue
            data = key[1]
            for offset in range(0, len(data), 8 * bs):
                parent = self._digest(parent + data[offset:offset + 8 * bs])
                known.append(parent)
                if until_uncached and parent not in self._cached:
                    return known
            if until_uncached and last - first == _PIECE:  # (every block of it cached)
                self._pieces[key] = tuple(known[-_PIECE:])
                if len(self._pieces) > self._max_pieces:
                    self._pieces.popitem(last=False)
        return known

    def root(self, cache_salt: str | None) -> bytes:
        """The first block's parent: the pool's salt, or a digest of it and a request's ``cache_salt`` (no
        chain of another salt, or of none, passes through it)."""
        if cache_salt is None:
            return self.salt
        return hashlib.sha256(self.salt + b"\0cache_salt\0" + cache_salt.encode()).digest()

    def match(self, hashes: Sequence[BlockHash]) -> list[int]:
        """The cached blocks of the longest prefix of ``hashes``, each with one more reference."""
        blocks = list(map(self._cached.get, hashes))
        if None in blocks:
            del blocks[blocks.index(None):]
        for block in blocks:
            if self._refs[block] == 0:
                del self._lru[block]
            self._refs[block] += 1
        return blocks

    def cache(self, block_ids: Sequence[int], hashes: Sequence[BlockHash]) -> None:
        """Make block ``block_ids[i]`` findable by ``hashes[i]`` (full blocks whose KV is computed); a hash
        already cached keeps its block (the duplicate is freed as an ordinary block)."""
        for block, h in zip(block_ids, hashes):
            if h not in self._cached and block not in self._hash_of:
                self._cached[h] = block
                self._hash_of[block] = h

    def reset(self) -> None:
        """Forget every cached block (``LLM.reset_prefix_cache``); blocks in use stay allocated, free ones are
        handed out after the other free blocks, least recently freed first."""
        self._cached.clear()
        self._hash_of.clear()
        self._plain[:0] = reversed(self._lru)
        self._lru.clear()
