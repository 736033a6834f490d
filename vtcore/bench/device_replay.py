"""The replay proposer on the device path, for ``vtcore bench --speculative-config`` (benchmark only).

The host's replay (:mod:`vtcore.spec.replay` with ``TeacherForcing``) needs a synchronous engine: it rewrites
each step's tokens on the host before the next step is prepared. An engine that drafts on the device (the
n-gram with async scheduling) schedules step N+1 before step N's tokens reach the host, so its verify steps
run at async depth 2, in the padded paths, with floating shares. ``DeviceReplay`` takes that path: it stands
in for the runner's device n-gram and keeps each running request's recorded sequence (prompt and the plain
run's continuation) in the n-gram's history rows; after sampling it forces every sampled token to the
recorded one (teacher forcing on the device: dummy weights' near-ties flip between a verify row's kernels
and a decode row's, and the recording would stop being the request's), and drafts the k recorded tokens
after the last accepted one, so every draft is accepted. The steps cost what all-accepted steps of a
device drafter cost.
"""
from __future__ import annotations

from typing import Any

import torch

from vtcore.worker.drafting import DraftRows, accepted_counts
from vtcore.worker.ngram import newly_seated
from vtcore.worker.step import Batch


class DeviceReplay:
    def __init__(self, sequences: dict[tuple[int, ...], list[int]], engine: Any) -> None:
        runner = engine.runner
        if runner.ngram is None or runner.mtp is not None:
            raise ValueError("the device replay stands in for the device n-gram: build the engine with "
                             "speculative_config method 'ngram' and async_scheduling=True")
        self.sequences = sequences  # prompt -> prompt and recorded continuation
        self.k = runner.ngram.k
        self.history = runner.ngram.history  # per mirror slot, its request's recorded sequence
        self._owner: dict[int, tuple[Any, int]] = {}
        self.sampled = 0
        self.agreed: torch.Tensor | int = 0  # (device: counted without a sync)
        self.runner = runner
        runner.ngram = self
        drafter = runner._draft

        def forced(out: dict[str, Any], f: Any, tokens: torch.Tensor, width: int, max_context_len: int) -> Any:
            known_slots, known_positions, known_tokens = f.draft_sections[7:]
            self.history[known_slots, known_positions] = known_tokens  # (before a new request's first token)
            if tokens.numel():
                self._force(out, f, tokens)
            return drafter(out, f, tokens, width, max_context_len)

        runner._draft = forced

    def _force(self, out: dict[str, Any], f: Any, tokens: torch.Tensor) -> None:
        """Every sampled token becomes the recorded one at its position (the mirror and the host copy too)."""
        at = (f.positions[f.sample_rows.long()] + 1).clamp(max=self.history.shape[1] - 1)
        recorded = self.history[f.sample_slots, at]
        self.sampled += tokens.numel()
        self.agreed = self.agreed + (tokens == recorded).sum()
        tokens.copy_(recorded)
        self.runner.last_sampled_tokens[f.sample_slots] = tokens
        out["tokens"] = self.runner._to_host(tokens)

    @property
    def agreement(self) -> float | None:
        """The share of sampled tokens the target itself sampled as recorded."""
        return float(self.agreed) / self.sampled if self.sampled else None

    def known(self, batch: Batch, rows: DraftRows) -> None:
        """Host: a request's first share in its slot since it was (re)admitted writes its whole recorded
        sequence into the history."""
        width = self.history.shape[1]
        for s in batch:
            req = s.request
            if not newly_seated(self._owner, req):
                continue
            seq = self.sequences[tuple(req.prompt_token_ids)][:width]
            rows.known_slots += [req.mirror_slot] * len(seq)
            rows.known_positions += range(len(seq))
            rows.known_tokens += seq

    def propose(self, fed: torch.Tensor, positions: torch.Tensor, tokens: torch.Tensor,
                sections: list[torch.Tensor], width: int, max_context_len: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The device n-gram's interface: the k recorded tokens after each sampling request's last accepted one,
        and the accepted counts."""
        _, base, first, _, _, widths, row_slots = sections[:7]  # (the known tokens are written: ``forced``)
        if not base.numel():
            return base.new_empty((0, self.k)), base
        accepted = accepted_counts(fed, tokens, base, first, widths, width)
        last = positions[base + accepted]
        follow = (last + 2)[:, None] + torch.arange(self.k, device=base.device)
        return self.history[row_slots[base][:, None], follow.clamp(max=self.history.shape[1] - 1)], accepted
