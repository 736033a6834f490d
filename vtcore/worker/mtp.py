"""Drafts from the target's own multi-token-prediction head (``model.mtp``), made on the device in each step.

After a general step's forward and sampling the head runs over every row of the step: at position p it
takes the target's hidden state at p and the token at p + 1, which is the next fed token where the host
knows it (a prompt's next token, also across a chunk boundary) and otherwise the token sampled at that
row. For a verify row's rows the token sampled after each position equals the draft token wherever the
target accepted it, so the head sees the tokens the request will keep. This writes the head's KV at the
step's positions, as the forward wrote the target's. A sampling request's first draft token is the
head's greedy choice at its last accepted row (its fed token's row plus the draft tokens accepted,
counted on the device); each further one runs the head one position on from its own last hidden state,
reading and writing its KV at positions the scheduler allocated ahead (past them, or past max_model_len,
nothing is written and the token is only a guess). What it wrote past the accepted tokens is overwritten
by the next step's pass over those positions, and verification keeps the target's tokens exact whatever
the head proposes.

A draft model drafts the same way (``DraftModelHead``, set as ``model.mtp`` by the engine): its pass over
the step's rows reads the fed tokens, not the next ones, so its KV holds every token the request keeps;
its first draft comes from one more position, the token sampled after the last accepted one, so its
chain runs k positions where the head's runs k - 1, and its logits are its own.

A head with stateful layers (a hybrid draft model) keeps their state as the target keeps its own: the
runner allocates its slots with the target's, and its pass over the step's rows runs the step's state
segments, so it leaves the state after each verified position in the request's draft-state slots (and
the next step resumes from the one after the last accepted token, as the target does). Its chain starts
from a copy of that state in a slot of its own per running request, so what the chain reads past the
accepted tokens leaves no trace.
"""
from __future__ import annotations

import time
from typing import Any, Callable, Sequence, TypeVar

import torch
from torch import nn

from vtcore.layers import parallel as tp
from vtcore.layers.attention import AttentionMetadata, set_attention_metadata
from vtcore.layers.state import copy_states, stateful_layers
from vtcore.worker.drafting import accepted_counts, resume_slots

_T = TypeVar("_T")


class DraftModelHead(nn.Module):
    """A draft model (any registered family, its own KV caches) as ``MTPDrafter``'s head."""

    reads_fed_tokens = True  # (an MTP head reads the token after each position)

    def __init__(self, draft: nn.Module) -> None:
        super().__init__()
        self.draft = draft

    def forward(self, ids: torch.Tensor, positions: torch.Tensor, hidden: torch.Tensor, step: int) -> torch.Tensor:
        return self.draft(ids, positions)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.draft.compute_logits(hidden)


def build_draft_head(path: str, device: torch.device, dtype: torch.dtype, max_position: int, load_format: str,
                     seed: int) -> DraftModelHead:
    """The draft model checkpoint at ``path`` built to draft on the device (every rank builds its own
    shard, as of the target); refused by name when a stateful layer of it cannot decode from slots named
    on the device (``StatefulLayer.supports_decode_graphs``), which its chain needs."""
    from vtcore.config import HFConfig
    from vtcore.errors import ConfigError
    from vtcore.loading.model_loader import build_model

    draft, family = build_model(path, HFConfig.from_path(path), device, dtype, max_position, load_format, seed)
    unable = sorted({type(m).__name__ for m in stateful_layers(draft) if not m.supports_decode_graphs})
    if unable:
        raise ConfigError(f"speculative_config: the draft model {path!r} (family {family.name!r}) has stateful "
                          f"layers ({', '.join(unable)}) that cannot decode from device slots "
                          "(StatefulLayer.supports_decode_graphs), which drafting on the device needs: "
                          "use async_scheduling=False (the host's draft engine)")
    return DraftModelHead(draft)



class MTPDrafter:
    """Runs ``model.mtp`` (an MTP head, or a ``DraftModelHead``) after each step (a padded step's at its
    shapes: ``vtcore.worker.drafter_graphs``) and returns each sampling request's ``k`` draft tokens."""

    def __init__(self, model: nn.Module, k: int, block_size: int, max_model_len: int, draft_state_base: int = 0,
                 chain_state_base: int = 0) -> None:
        self.model, self.head, self.k = model, model.mtp, k
        #: the head's stateful layers; the target's draft-state slots (``k`` a running request, after its own
        #: slot and the snapshots) and the chain's slots (one a running request) in them
        self.stateful = stateful_layers(self.head)
        self.draft_state_base, self.chain_state_base = draft_state_base, chain_state_base
        self.reads_fed = getattr(self.head, "reads_fed_tokens", False)
        self.logits = self.head.compute_logits if self.reads_fed else model.compute_logits
        #: positions past a step's last one that its drafting writes KV at (the scheduler allocates them)
        self.lookahead = k if self.reads_fed else k - 1
        self.tp_group = tp.tp()  # the ranks the head runs on (its layers shard as the model's do)
        self.block_size, self.max_model_len = block_size, max_model_len
        #: set to [] to time every ``propose`` (a benchmark's): CUDA event pairs on CUDA, else perf_counter pairs
        self.timings: list[tuple[Any, Any]] | None = None

    def timed_ms(self) -> list[float]:
        """The recorded ``propose`` times, ms (waits for CUDA events)."""
        return [a.elapsed_time(b) if isinstance(a, torch.cuda.Event) else (b - a) * 1e3 for a, b in self.timings or ()]

    def _mark(self, device: torch.device) -> Any:
        if device.type != "cuda":
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def propose(self, hidden: torch.Tensor, md: AttentionMetadata, positions: torch.Tensor, fed: torch.Tensor,
                tokens: torch.Tensor | None, sample_rows: torch.Tensor, sections: list[torch.Tensor], width: int,
                end_saves: Sequence[tuple[int, int]] = ()) -> tuple[torch.Tensor, torch.Tensor]:
        """``hidden`` [T, H] the step's final-norm hidden states, ``md`` / ``positions`` its metadata, ``fed``
        its fed ids (draft tokens included), ``tokens`` its sampled tokens at ``sample_rows`` (a
        tensor-parallel worker: None, rank 0's are broadcast); ``sections`` the device views of
        :meth:`DraftRows.sections`; ``end_saves`` the step's (snapshot slot, state slot) copies after its
        forward, which the head's stateful layers make after its pass. Returns, the same on every rank, int64
        [sampling requests, k] drafts and [sampling requests] the draft tokens each verify row accepted
        (``accepted_counts``)."""
        next_ids, base, _, table_rows, capacity, widths, row_slots = sections[:7]

        def drafted() -> tuple[torch.Tensor, torch.Tensor]:
            ids = next_ids.index_put((sample_rows,), self.shared_tokens(tokens, sample_rows))
            if not base.numel():  # no row samples: the pass writes the head's KV, nothing to draft
                self.run_pass(hidden, md, positions, fed, ids)
                result = base.new_empty((0, self.k)), base
            else:
                result = self.draft(hidden, md, positions, fed, ids, base, table_rows, capacity, widths, row_slots,
                                    width)
            self.save_ends(end_saves)
            return result
        return self.timed(drafted, hidden.device)

    def shared_tokens(self, tokens: torch.Tensor | None, sample_rows: torch.Tensor) -> torch.Tensor:
        """The step's sampled tokens, rank 0's on every rank of several (None on a worker)."""
        if self.tp_group.collective:
            tokens = tp.broadcast(torch.empty(sample_rows.numel(), dtype=torch.int64, device=sample_rows.device)
                                  if tokens is None else tokens.to(torch.int64).contiguous(), self.tp_group)
        return tokens

    def timed(self, drafted: Callable[[], _T], device: torch.device) -> _T:
        """``drafted()``, its time recorded when ``timings`` is a list."""
        if self.timings is None:
            return drafted()
        start = self._mark(device)
        result = drafted()
        self.timings.append((start, self._mark(device)))
        return result

    def run_pass(self, hidden: torch.Tensor, md: AttentionMetadata, positions: torch.Tensor, fed: torch.Tensor,
                 ids: torch.Tensor) -> torch.Tensor:
        """The head's pass over the step's rows (``ids``: the next ids, the sampled tokens in them): its KV
        (and states) at the step's slots; returns its hidden states."""
        return self._run(fed if self.reads_fed else ids, positions, hidden, md, 0)

    def save_ends(self, end_saves: Sequence[tuple[int, int]]) -> None:
        """The step's (snapshot slot, state slot) copies in the head's stateful layers, after its pass."""
        for dst, src in end_saves:
            copy_states(self.stateful, dst, src)

    def draft(self, hidden: torch.Tensor, md: AttentionMetadata, positions: torch.Tensor, fed: torch.Tensor,
              ids: torch.Tensor, base: torch.Tensor, table_rows: torch.Tensor, capacity: torch.Tensor,
              widths: torch.Tensor, row_slots: torch.Tensor, width: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The pass and each sampling request's chain, no host value read (a padded step's is captured in a
        graph: ``vtcore.worker.drafter_graphs``). ``ids``: the next ids with the sampled tokens in them (a
        verify row's sampled tokens are at its rows from its fed token's ``base``, so the tokens sampled
        before its draft tokens are ``ids[base + i]``); ``table_rows``, ``capacity``, ``widths`` per
        sampling request as :class:`DraftRows` has them; ``width`` at least the longest draft. Returns the
        drafts [requests, k] and the accepted counts [requests]; the head's stateful layers' end-of-row saves
        are the caller's (the chain leaves the states they copy as the pass left them)."""
        h = self.run_pass(hidden, md, positions, fed, ids)
        accepted = accepted_counts(fed, ids, base, base, widths, width)
        rows = base + accepted
        h, pos = h[rows], positions[rows]
        chain = self._chain_states(row_slots[base], widths, accepted) if self.stateful else None
        continues = None if chain is None else torch.ones_like(chain, dtype=torch.bool)
        # a draft model's chain starts one position on, at the token sampled after the last accepted one
        out = [ids[rows]] if self.reads_fed else [self._greedy(h)]
        tables = md.block_tables[table_rows]
        room = capacity.clamp(max=min(self.max_model_len, tables.shape[1] * self.block_size))
        for step in range(1, self.k + self.reads_fed):
            pos = pos + 1
            inside = pos < room
            at = torch.where(inside, pos, room - 1)  # a guess past the allocated blocks reads, never writes
            block = tables.gather(1, (at // self.block_size)[:, None])[:, 0]
            slots = torch.where(inside, block * self.block_size + at % self.block_size, -1)
            n = rows.numel()
            step_md = AttentionMetadata(
                slot_mapping=slots, block_tables=tables, context_lens=(at + 1).to(md.context_lens.dtype),
                query_start_loc=torch.arange(n + 1, device=pos.device, dtype=md.query_start_loc.dtype),
                max_query_len=1, max_context_len=md.max_context_len + self.k, state_index=chain,
                state_continues=continues)
            h = self._run(out[-1], at, h, step_md, step)
            out.append(self._greedy(h))
        return torch.stack(out[self.reads_fed:], dim=1), accepted

    def _chain_states(self, mirror: torch.Tensor, widths: torch.Tensor, accepted: torch.Tensor) -> torch.Tensor:
        """Copy each sampling request's state after its last accepted token (a draft-state slot, or its own
        slot when it accepted its whole draft) into its chain slot, which it returns."""
        chain = self.chain_state_base + mirror
        copy_states(self.stateful, chain, resume_slots(self.draft_state_base, self.k, mirror, accepted, widths))
        return chain

    def _run(self, ids: torch.Tensor, positions: torch.Tensor, hidden: torch.Tensor, md: AttentionMetadata,
             step: int) -> torch.Tensor:
        set_attention_metadata(md)
        try:
            return self.head(ids, positions, hidden, step)
        finally:
            set_attention_metadata(None)

    def _greedy(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.logits(hidden).float().argmax(dim=-1)
