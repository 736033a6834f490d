"""What a drafter on the device (an MTP head, the device n-gram) needs of a step, and the accepted count.

Drafts made on the device never visit the host before they are verified: each step the drafter runs
after sampling over the step's rows (``DraftRows``), and the runner keeps per running request the draft,
the accepted count of its verify row (``accepted_counts``) and its last accepted token for the next
step, whose shares of those requests float over that count (``vtcore.worker.step.Scheduled.floats``).
"""
from __future__ import annotations

from typing import Any

import attrs
import torch

from vtcore.worker.step import Batch

NO_TOKEN = -1  # a row whose next token is the one sampled there
PADDING_TOKEN = 0  # a padded row's next token: any valid id (a pass over it writes no KV; its output is unread)


@attrs.define
class DraftRows:
    """A step's host sections for a device drafter: per row the next token (``NO_TOKEN``: the row's sampled
    token) and the row's mirror slot; per sampling request its fed token's row, the index of its first
    sampled token, its row in the block table, the tokens its blocks hold and its draft's length (at most
    ``width``); and (slot, position, token) triples of tokens the step does not feed that a drafter reading
    a request's whole sequence must know (a cached prefix: ``known_tokens``)."""

    next_ids: list[int] = attrs.Factory(list)
    base_rows: list[int] = attrs.Factory(list)
    first_samples: list[int] = attrs.Factory(list)
    table_rows: list[int] = attrs.Factory(list)
    capacity: list[int] = attrs.Factory(list)
    widths: list[int] = attrs.Factory(list)
    row_slots: list[int] = attrs.Factory(list)
    known_slots: list[int] = attrs.Factory(list)
    known_positions: list[int] = attrs.Factory(list)
    known_tokens: list[int] = attrs.Factory(list)
    width: int = 0

    def sections(self) -> list[list[int]]:
        return [self.next_ids, self.base_rows, self.first_samples, self.table_rows, self.capacity, self.widths,
                self.row_slots, self.known_slots, self.known_positions, self.known_tokens]

    def padded(self, size: int, stride: int) -> list[int]:
        """One section at a padded step's fixed shapes (``vtcore.worker.drafter_graphs``): per token the next
        id and the mirror slot, then per sampling request, padded to ``size`` requests, its fed token's row,
        block-table row, capacity and draft length. A padded request j drafts from the first token of row j
        (``stride`` tokens a row) with capacity 1 (its chain's positions are all past it: no KV written) and
        no draft (nothing accepted)."""
        pad = range(len(self.base_rows), size)
        return [*self.next_ids, *self.row_slots, *self.base_rows, *(j * stride for j in pad), *self.table_rows,
                *pad, *self.capacity, *[1] * len(pad), *self.widths, *[0] * len(pad)]


def draft_rows(batch: Batch, block_size: int, stride: int = 0, size: int = 0, dummy_slot: int = 0) -> DraftRows:
    """The drafter's sections of ``batch``, its rows laid out as the runner lays them out: in batch order,
    each share's tokens after the last's, or (a padded step) ``stride`` tokens a share and ``size`` shares,
    the padding's tokens in ``dummy_slot``."""
    rows = DraftRows(width=max((len(s.draft) for s in batch), default=0))
    row0 = sampled = 0
    for seq, s in enumerate(batch):
        req, fed = s.request, s.num_tokens - len(s.draft)
        tokens = req.token_ids
        for p in range(s.start, s.start + s.num_tokens):
            known = p + 1 < s.start + fed or (not s.samples and p + 1 < len(tokens))
            rows.next_ids.append(tokens[p + 1] if known else NO_TOKEN)
        rows.row_slots += [req.mirror_slot] * s.num_tokens
        padding = stride - s.num_tokens if stride else 0
        rows.next_ids += [PADDING_TOKEN] * padding
        rows.row_slots += [dummy_slot] * padding
        if s.samples:
            rows.base_rows.append(row0 + fed - 1)
            rows.first_samples.append(sampled)
            rows.table_rows.append(seq)
            rows.capacity.append(len(req.block_ids) * block_size)
            rows.widths.append(len(s.draft))
        row0 += s.num_tokens + padding
        sampled += s.num_sampled
    padding = (size - len(batch)) * stride
    rows.next_ids += [PADDING_TOKEN] * padding
    rows.row_slots += [dummy_slot] * padding
    return rows


def accepted_counts(fed: torch.Tensor, tokens: torch.Tensor, base: torch.Tensor, first: torch.Tensor,
                    widths: torch.Tensor, width: int) -> torch.Tensor:
    """Per sampling request, how many of its ``widths`` draft tokens (fed in the rows after its fed token's
    row ``base``) equal the token sampled before each (its sampled tokens start at ``first`` of
    ``tokens``): the verify row's accepted draft tokens, counted on the device. ``width``: the longest draft."""
    if not width:
        return torch.zeros_like(base)
    i = torch.arange(width, device=base.device)
    drafts = fed[(base[:, None] + 1 + i).clamp(max=fed.numel() - 1)]
    sampled = tokens[(first[:, None] + i).clamp(max=tokens.numel() - 1)]
    return ((sampled == drafts) & (i < widths[:, None])).long().cumprod(1).sum(1)


def draft_state_slot(draft_state_base: int, per_request: int, mirror: Any, accepted: Any) -> Any:
    """The state slot holding a verify row's state after its fed token and ``accepted`` draft tokens (fewer
    than its draft's length): ``per_request`` such slots a running request (by its mirror slot), from
    ``draft_state_base``. Host ints or device tensors alike."""
    return draft_state_base + mirror * per_request + accepted


def resume_slots(draft_state_base: int, per_request: int, mirror: torch.Tensor, accepted: torch.Tensor,
                 widths: torch.Tensor) -> torch.Tensor:
    """The state slot each request resumes from after its verify row (``accepted`` of its ``widths`` draft
    tokens kept): the draft-state slot of that count, or its own slot (``mirror``) when it kept its whole
    draft."""
    return torch.where(accepted < widths, draft_state_slot(draft_state_base, per_request, mirror, accepted), mirror)
