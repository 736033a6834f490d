"""What a step is to the runner: the scheduled rows it gets and the results it hands back.

The scheduler (vtcore.engine) builds ``Batch``es of ``Scheduled`` rows over its requests; the runner
sees a request only through ``StepRequest``, the attributes it reads and the two it writes, so the
worker package needs nothing from the engine.
"""
from __future__ import annotations

from array import array
from typing import Any, Protocol

import attrs

#: a draft token the runner takes from the device (drafts made there, by an MTP head, in the step before)
DEVICE_DRAFT = -1


class StepRequest(Protocol):
    """A request as the runner and the sampler see it."""

    request_id: str
    token_ids: list[int]  # prompt, then the outputs the host knows
    grammar: Any  # a RequestGrammar (structured outputs) or None
    is_finished: bool  # ended (stopped or aborted), perhaps while a step of it was in flight
    num_prompt_tokens: int
    block_ids: list[int]  # its KV blocks, in position order
    mirror_slot: int  # its stable row of the device mirror and of the state caches while it runs
    params: Any  # its SamplingParams
    bad_words: tuple[tuple[int, ...], ...]  # its params' bad_words as token id spellings
    prompt_logprobs: Any  # None, or the prompt logprobs collected so far
    prompt_logprobs_scheduled: int  # prompt positions whose logprobs a step already asked for (the runner advances it)


@attrs.define
class Scheduled:
    """One request's share of a step: tokens ``[start, start + num_tokens)``; ``samples`` if its last row samples.

    Prefix caching of stateful layers (hybrid families): ``restore``, a snapshot slot whose state the
    request resumes from (copied into its state slot before the step), or -1; ``saves``, (tokens of
    this share consumed, snapshot slot) pairs: the state after that many tokens is written there.

    Speculative decoding: ``draft``, tokens proposed to follow the share's known ones; they are its
    last ``len(draft)`` tokens, and each of its last ``len(draft) + 1`` rows samples (a verify row).
    ``resume``: after a verify row that accepted fewer than its draft's tokens, how many it accepted:
    the stateful layers resume from the state kept after that many (-1: from their slot as it is).
    ``draft`` tokens equal to ``DEVICE_DRAFT`` come from the device's drafts of the request.

    ``floats``: the share follows a verify row of ``floats`` draft tokens whose accepted count the host
    may not know yet (``vtcore.engine.scheduler``): its positions are ``start`` and on plus that count,
    added on the device, where its fed token (the last accepted one) comes from the mirror and its
    stateful layers resume from the state after it. ``verify``: the scheduler's record of this share's
    verify row, which the engine tells the accepted count.
    """

    request: StepRequest
    start: int
    num_tokens: int
    samples: bool
    restore: int = -1
    saves: tuple[tuple[int, int], ...] = ()
    draft: tuple[int, ...] = ()
    resume: int = -1
    floats: int = 0
    verify: Any = None

    @property
    def num_sampled(self) -> int:
        """Rows of this share that sample: none, one, or one per draft token and one more."""
        return len(self.draft) + 1 if self.samples else 0


#: A step's work, in row order.
Batch = list[Scheduled]


@attrs.define
class StepOutput:
    """One step's results on the host, in the order of the step's sampling requests."""

    token_ids: list[int]
    logprobs: list[float] | None
    ranks: list[int] | None
    top_ids: list[list[int]] | None
    top_logprobs: list[list[float]] | None
    prompt_logprobs: dict[str, list]  # request_id -> per-position {id: (logprob, rank)}
    drafts: list[list[int]] | None = None  # per sampling request: its MTP head's draft (``vtcore.worker.mtp``)
    accepted: list[int] | None = None  # per sampling request: its draft tokens the device accepted (with drafts)


def kv_slots(block_ids: list[int], block_size: int, start: int, end: int) -> list[int]:
    """The KV cache slots of positions ``start..end-1`` of a request whose blocks are ``block_ids``:
    ``block_ids[p // block_size] * block_size + p % block_size``, made a block at a time (a long chunk's
    slots are on the host's path before the device may start)."""
    if end - start < block_size:  # (a decode or verify row: one expression a token is quicker)
        return [block_ids[p // block_size] * block_size + p % block_size for p in range(start, end)]
    check_blocks(block_ids, block_size, start, end)
    first = start // block_size
    slots: list[int] = []
    for block in block_ids[first:-(-end // block_size)]:
        slots += range(block * block_size, (block + 1) * block_size)
    return slots[start - first * block_size:end - first * block_size]


#: 0, 1, 2, ... as native int64s, replaced by a longer one when a slice would pass its end (a view of the old one
#: stays valid): a chunk's positions, and each block's KV slots, are slices of it
_COUNTING = [array("q")]
#: the longest the counting table grows (32 MB): a chunk past it (a small model's pool of tens of millions of
#: slots) is laid out as lists
COUNTING_MAX = 1 << 22


def int64_range(start: int, end: int) -> memoryview:
    """``start, ..., end - 1`` (``end`` at most ``COUNTING_MAX``) as native int64s (format ``q``), a view of a shared
    table: no Python int each."""
    table = _COUNTING[0]
    if len(table) < end:
        if end > COUNTING_MAX:
            raise ValueError(f"int64_range: end={end}: expected at most COUNTING_MAX={COUNTING_MAX}")
        table = _COUNTING[0] = array("q", range(min(max(end, 2 * len(table)), COUNTING_MAX)))
    return memoryview(table)[start:end]


def int64s(*parts: Any) -> memoryview:
    """Buffers of native int64s end to end, as one (format ``q``)."""
    return memoryview(b"".join(parts)).cast("q")


def kv_slot_int64s(block_ids: list[int], block_size: int, start: int, end: int, length: int) -> memoryview:
    """``kv_slots`` as native int64s, padded with -1 (no slot) to ``length``: per block a slice of the shared
    counting table joined, without a Python int a token (a long chunk's layout)."""
    check_blocks(block_ids, block_size, start, end)
    bs, first = block_size, start // block_size
    blocks = block_ids[first:-(-end // block_size)]
    table = int64_range(0, (max(blocks) + 1) * bs)
    joined = memoryview(b"".join([table[b * bs:(b + 1) * bs] for b in blocks])).cast("q")
    return int64s(joined[start - first * bs:end - first * bs], array("q", [-1]) * (length - end + start))


def check_blocks(block_ids: list[int], block_size: int, start: int, end: int) -> None:
    """Raise ``IndexError`` unless ``block_ids`` reach position ``end - 1``."""
    if -(-end // block_size) > len(block_ids):
        raise IndexError(f"kv_slots: positions {start}..{end - 1} need {-(-end // block_size)} blocks, the request "
                         f"has {len(block_ids)}")
