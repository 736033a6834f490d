"""The n-gram proposer on the device: prompt lookup for the async engine.

The host's n-gram proposer (``vtcore.spec.ngram``) reads a request's tokens, which the async engine's host
does not have yet when it schedules the next step. This one keeps every running request's sequence on the
device (``history``, a row per mirror slot), written each step from the fed ids, the tokens of a cached
prefix the step does not feed, and the last accepted token, and searches it after sampling with the host
proposer's rule: for n from ``max_n`` down to ``min_n``, the latest earlier occurrence of the last n
tokens, and what followed it is the draft. The host laid the verify rows out before the search, so a
draft is always k tokens: past the end of what followed the match, and for a request with no match, its
last token repeated (verification keeps the tokens exact whatever is proposed).
"""
from __future__ import annotations

from typing import Any

import torch

from vtcore.worker.drafting import DraftRows, accepted_counts
from vtcore.worker.step import Batch


def newly_seated(owners: dict[int, tuple[Any, int]], req: Any) -> bool:
    """Whether ``req``'s share is its first in its mirror slot since it was (re)admitted; records it in
    ``owners`` (mirror slot -> the request and admission its history row holds)."""
    held = owners.get(req.mirror_slot)
    if held is not None and held[0] is req and held[1] == req.num_preemptions:
        return False
    owners[req.mirror_slot] = (req, req.num_preemptions)
    return True


class DeviceNgram:
    def __init__(self, min_n: int, max_n: int, k: int, max_num_seqs: int, max_model_len: int,
                 device: torch.device) -> None:
        self.min_n, self.max_n, self.k = min_n, max_n, k
        #: per mirror slot its request's tokens by position (one past max_model_len: a last token's successor)
        self.history = torch.zeros((max_num_seqs + 1, max_model_len + 1), dtype=torch.int64, device=device)
        self._owner: dict[int, tuple[Any, int]] = {}  # mirror slot -> (request, admission) its row holds (host)

    def known(self, batch: Batch, rows: DraftRows) -> None:
        """Host: a request's first share in its slot since it was (re)admitted that starts past 0 (a cached
        prefix) leaves the tokens before it unfed; they go to the history with the step
        (``DraftRows.known_tokens``)."""
        for s in batch:
            req = s.request
            if not newly_seated(self._owner, req):
                continue
            rows.known_slots += [req.mirror_slot] * s.start
            rows.known_positions += range(s.start)
            rows.known_tokens += req.token_ids[:s.start]

    def propose(self, fed: torch.Tensor, positions: torch.Tensor, tokens: torch.Tensor,
                sections: list[torch.Tensor], width: int, max_context_len: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Write the step into the history and draft: ``fed`` / ``positions`` the step's fed ids and (shifted)
        positions, ``tokens`` its sampled tokens; ``sections`` the device views of ``DraftRows.sections``.
        Returns int64 [sampling requests, k] drafts and [sampling requests] the accepted counts."""
        _, base, first, _, _, widths, row_slots, known_slots, known_positions, known_tokens = sections
        history = self.history
        history[known_slots, known_positions] = known_tokens
        history[row_slots, positions] = fed
        if not base.numel():  # no row samples: the step's tokens are recorded, nothing to draft
            return base.new_empty((0, self.k)), base
        accepted = accepted_counts(fed, tokens, base, first, widths, width)
        slots = row_slots[base]
        last = positions[base + accepted]  # the last accepted token's row: the token sampled there follows
        history[slots, last + 1] = tokens[first + accepted]
        return self.search(history[slots, :min(history.shape[1], max_context_len + 2)], last + 2), accepted

    def search(self, rows: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        """``rows`` [R, T] sequences, the first ``lengths`` tokens of each its own: [R, k] drafts (module doc).

        One pass for every n (a fixed count of launches, whatever ``max_n - min_n``): for each end position e
        before the last token, how many of the last ``max_n`` tokens match backwards from e; the longest match
        of at least ``min_n`` wins, the latest e among equals (the host's rule: longest n first, then the
        latest occurrence), and the draft is what followed e."""
        r, span = rows.shape
        n = self.max_n
        # windows[:, e, n - 1 - j] = rows[:, e - j] (-1 before the start); the tail likewise (-2: never equal)
        windows = torch.cat([rows.new_full((r, n - 1), -1), rows], 1).unfold(1, n, 1)
        at = lengths[:, None] - n + torch.arange(n, device=rows.device)
        tail = torch.where(at >= 0, rows.gather(1, at.clamp(min=0)), -2)
        matched = (windows == tail[:, None, :]).flip(-1).cumprod(-1).sum(-1)  # [R, T]: match length ending at e
        end = torch.arange(span, device=rows.device)
        valid = (end[None, :] <= lengths[:, None] - 2) & (matched >= self.min_n)
        best = torch.where(valid, matched * span + end[None, :], -1).amax(1)
        follow = (best % span + 1)[:, None] + torch.arange(self.k, device=rows.device)
        found = (best[:, None] >= 0) & (follow < lengths[:, None])
        last = rows.gather(1, (lengths[:, None] - 1).clamp(min=0))
        return torch.where(found, rows.gather(1, follow.clamp(0, span - 1)), last)
