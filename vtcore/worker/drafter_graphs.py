"""An MTP head's or a draft model's drafting after a padded step, at that step's fixed shapes.

Eager, a drafter's pass over the step's rows and its chain of one-token forwards are launch-bound: a
draft model's forward alone is hundreds of launches from Python, several times the device time of a
small model's step (docs/BENCHMARKS.md). After a padded step (``vtcore.worker.decode_graphs``) every input
of :meth:`MTPDrafter.draft` can be a fixed tensor: the target graph's outputs (each padded token's hidden
state and fed id, the metadata its forward read), its positions, and one buffer holding the step's
:meth:`DraftRows.padded` section (per token the next id and mirror slot, then the sampling requests padded
to the step's padded size). So on CUDA the drafter is captured once per padded size, after the target's
graphs and into their memory pool, and replayed after sampling; a step's own part is one copy of its
staged section into the buffer and its sampled tokens scattered into the next ids there. The first
``requests`` rows of the outputs are the step's sampling requests; a padded request's are never read. A
lone chunk that samples nothing (a prompt's chunk before its last) replays a graph of the pass alone.
On CPU (no graphs) the same padded call runs eagerly, with the step's own context bound.
"""
from __future__ import annotations

import functools
from typing import Any, Sequence

import torch

from vtcore.layers.attention import AttentionMetadata
from vtcore.worker.decode_graphs import DecodeGraphs, PaddedOutputs, capture_graph, no_collection
from vtcore.worker.drafting import PADDING_TOKEN, DraftRows
from vtcore.worker.mtp import MTPDrafter
from vtcore.worker.staging import host_tensor


class DrafterGraphs:
    """``drafter`` after the padded steps of ``target``; ``dummy_slot`` the mirror slot padded rows name."""

    def __init__(self, drafter: MTPDrafter, target: DecodeGraphs, dummy_slot: int) -> None:
        self.drafter, self.target, self.dummy_slot = drafter, target, dummy_slot
        #: the longest draft a row of the target's steps can have (a chunk's rows: none)
        self.width = 0 if target.chunk else target.q - 1
        largest = target.sizes[-1] if target.sizes else 0
        self.buffer = torch.zeros((2 * target.q + 4) * largest, dtype=torch.int64, device=target.device)
        self.views = {p: self._sections(p) for p in target.sizes}
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, tuple[torch.Tensor, torch.Tensor]]] = {}
        #: a chunk that samples nothing (a prompt's chunk before its last) needs the pass alone: its graphs
        #: (with ``None`` for outputs: the pass writes KV and states only)
        self.passes: dict[int, tuple[torch.cuda.CUDAGraph, None]] = {}
        self.replays = 0  # steps whose drafting replayed a graph

    def _sections(self, p: int) -> list[torch.Tensor]:
        """Next ids and row slots ([p * q] each), fed rows, table rows, capacity and widths ([p] each)."""
        t = p * self.target.q
        bounds = [0, t, 2 * t] + [2 * t + i * p for i in range(1, 5)]
        return [self.buffer[a:b] for a, b in zip(bounds, bounds[1:])]

    def _draft(self, p: int, outputs: PaddedOutputs, positions: torch.Tensor,
               md: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        ids, row_slots, base, table_rows, capacity, widths = self.views[p]
        return self.drafter.draft(outputs.hidden, md, positions, outputs.fed, ids, base, table_rows, capacity,
                                  widths, row_slots, self.width)

    def _pass(self, p: int, outputs: PaddedOutputs, positions: torch.Tensor, md: AttentionMetadata) -> None:
        self.drafter.run_pass(outputs.hidden, md, positions, outputs.fed, self.views[p][0])

    def capture(self, pool: Any) -> Any:
        """Capture the drafter after each of the target's captured sizes, largest first, into ``pool`` (the
        target's); returns the pool. Every row padded, and the target's graph replayed so that its outputs,
        which the warm-up reads, are its padded rows' (an out-of-range fed id would fail the draft model's
        embedding): neither the target's metadata nor the drafter's chains name a KV slot."""
        q = self.target.q
        with torch.inference_mode(), no_collection():
            for p in reversed(self.target.sizes):
                captured = self.target.graphs.get(p)
                if captured is None:
                    continue
                graph, outputs = captured
                self.target.pad_rows(p)
                graph.replay()  # (its outputs, captured but never computed, hold whatever the pool held)
                padding = DraftRows(next_ids=[PADDING_TOKEN] * (p * q), row_slots=[self.dummy_slot] * (p * q))
                section = host_tensor(padding.padded(p, q), torch.int64)
                self.buffer[:section.numel()].copy_(section)
                inputs = (p, outputs, self.target.views[p][1], outputs.metadata)  # (positions: the views')
                self.graphs[p] = capture_graph(functools.partial(self._draft, *inputs), self.target.device, pool)
                pool = self.graphs[p][0].pool()
                if self.target.chunk:
                    self.passes[p] = capture_graph(functools.partial(self._pass, *inputs), self.target.device, pool)
        torch.cuda.synchronize(self.target.device)
        return pool

    def propose(self, size: int, requests: int, section: torch.Tensor, sample_rows: torch.Tensor,
                tokens: torch.Tensor | None, outputs: PaddedOutputs, positions: torch.Tensor, md: AttentionMetadata,
                end_saves: Sequence[tuple[int, int]]) -> tuple[torch.Tensor, torch.Tensor]:
        """A padded step of padded size ``size`` and ``requests`` sampling requests: its staged
        :meth:`DraftRows.padded` ``section``, its sampled ``tokens`` at ``sample_rows`` (a tensor-parallel
        worker: None), its forward's ``outputs`` and ``positions``, ``md`` the metadata an eager run reads
        (the step's own context bound), ``end_saves`` the head's stateful layers' copies after it. Returns
        the requests' drafts [requests, k] and accepted counts [requests]; a step without any runs the pass
        alone (its KV, its states)."""

        def drafted() -> tuple[torch.Tensor, torch.Tensor]:
            self.buffer[:section.numel()].copy_(section)
            self.views[size][0].index_put_((sample_rows,), self.drafter.shared_tokens(tokens, sample_rows))
            if not requests:  # a prompt's chunk before its last: the pass alone (its KV, its states)
                self._replay_or_run(self.passes.get(size), lambda: self._pass(size, outputs, positions, md))
                result = self.buffer.new_empty((0, self.drafter.k)), self.buffer.new_empty(0)
            else:
                drafts, accepted = self._replay_or_run(self.graphs.get(size),
                                                       lambda: self._draft(size, outputs, positions, md))
                result = drafts[:requests], accepted[:requests]
            self.drafter.save_ends(end_saves)
            return result
        return self.drafter.timed(drafted, self.buffer.device)

    def _replay_or_run(self, captured: tuple[torch.cuda.CUDAGraph, Any] | None, run: Any) -> Any:
        """The captured graph replayed (its outputs), or ``run()`` where that size has none (CPU, sizes not
        captured)."""
        if captured is None:
            return run()
        captured[0].replay()
        self.replays += 1
        return captured[1]
