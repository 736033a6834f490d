"""Pure-decode steps padded to fixed batch sizes, and on CUDA one captured graph per size.

One flat int64 buffer holds, for padded size P, six sections of P rows (ids, positions, KV slots,
context lengths, combine slots, mirror slots), then the real rows' block table; a step uploads into
it with one copy, and the block table is copied into the persistent ``[P, max_blocks]`` table the
kernels read. The combine (-1: the host id is current) runs inside the graph. Padded rows: id 0,
position 0, KV slot -1 (never written), context 1, no combine, the dummy mirror slot; their samples
are never written to the mirror. On CPU the same padded forward runs eagerly (nothing is captured).
"""
from __future__ import annotations

import contextlib
import gc
from typing import Callable, Iterator

import attrs
import torch

from vtcore.worker.step import Batch

GRAPH_SIZES = (1, 2, 4, 8, *range(16, 257, 16))  # padded decode batch sizes (one CUDA graph each)
GRAPH_MAX = 256  # larger decode batches run eagerly
PLACEHOLDER = -1  # the host id of a token still in flight; never a real token

#: forward(ids, positions, kv slots, context lens, combine slots, mirror slots, block tables, query starts,
#: max_context_len) -> (fed ids, float32 logits, whether EmbedInto consumed the override)
DecodeForward = Callable[..., tuple[torch.Tensor, torch.Tensor, bool]]


@attrs.define
class DecodeInputs:
    """A pure-decode step on the host: padded size, real rows, block-table width and the sections to stage."""

    size: int
    rows: int
    width: int
    sections: list[list[int]]
    stale: bool  # some row's token is still in flight (filled on the device by the combine)
    max_context_len: int


class DecodeGraphs:
    def __init__(self, forward: DecodeForward, device: torch.device, block_size: int, max_model_len: int,
                 max_num_seqs: int, dummy_slot: int, capture: bool) -> None:
        self.forward, self.device, self.block_size = forward, device, block_size
        self.padding = [0, 0, -1, 1, -1, dummy_slot]
        largest = min(max_num_seqs, GRAPH_MAX)
        self.sizes = [p for p in GRAPH_SIZES if p < largest] + [largest]
        self.max_table = -(-max_model_len // block_size)
        self.buffer = torch.zeros(6 * largest + largest * self.max_table, dtype=torch.int64, device=device)
        self.tables = torch.zeros(largest, self.max_table, dtype=torch.int32, device=device)
        self.qstart = torch.arange(largest + 1, dtype=torch.int32, device=device)
        # the six sections of padded size p: views fixed once, as the graphs read them
        self.views = {p: [self.buffer[i * p:(i + 1) * p] for i in range(6)] for p in self.sizes}
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, tuple[torch.Tensor, torch.Tensor], bool]] = {}
        self.steps = self.replays = 0  # padded decode steps run, and how many of them replayed a graph
        if capture:
            self._capture(max_model_len)

    def takes(self, batch: Batch) -> bool:
        """A pure-decode batch (one sampled token a row) that fits the largest padded size."""
        return len(batch) <= self.sizes[-1] and all(s.num_tokens == 1 and s.samples for s in batch)

    def padded_size(self, rows: int) -> int:
        """The padded batch size a decode step of ``rows`` rows runs at."""
        return next(size for size in self.sizes if size >= rows)

    def _run(self, p: int, max_context_len: int) -> tuple[torch.Tensor, torch.Tensor, bool]:
        return self.forward(*self.views[p], self.tables[:p], self.qstart[:p + 1], max_context_len)

    def _capture(self, max_model_len: int) -> None:
        pool = None
        with torch.inference_mode(), _no_collection():
            for p in reversed(self.sizes):  # largest first: the others reuse its memory pool
                padding = torch.tensor(self.padding, device=self.device)[:, None]
                self.buffer[:6 * p].view(6, p).copy_(padding)  # all rows padded: the capture writes no KV
                self._run(p, max_model_len)  # warm-up: compiles kernels, sizes workspaces
                torch.cuda.synchronize(self.device)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool):
                    fed, logits, consumed = self._run(p, max_model_len)
                pool = graph.pool()
                self.graphs[p] = (graph, (fed, logits), consumed)
        torch.cuda.synchronize(self.device)

    def prepare(self, batch: Batch) -> DecodeInputs:
        """The host side of a padded decode step of ``batch``."""
        bs, n = self.block_size, len(batch)
        p = self.padded_size(n)
        cols: list[list[int]] = [[] for _ in range(6)]
        width = max(len(s.request.block_ids) for s in batch)
        table: list[int] = []
        stale = False
        for s in batch:
            req, pos = s.request, s.start
            known = pos < len(req.token_ids)
            stale |= not known
            for col, v in zip(cols, (req.token_ids[pos] if known else PLACEHOLDER, pos,
                                     req.block_ids[pos // bs] * bs + pos % bs, pos + 1,
                                     -1 if known else req.mirror_slot, req.mirror_slot)):
                col.append(v)
            table += req.block_ids + [0] * (width - len(req.block_ids))
        for col, v in zip(cols, self.padding):
            col += [v] * (p - n)
        return DecodeInputs(p, n, width, cols + [table], stale, max(s.start for s in batch) + 1)

    def run(self, inputs: DecodeInputs, table_rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, bool]:
        """The device side, after the sections were uploaded into ``buffer``: (fed ids, logits, consumed)
        of the real rows; a graph replay where one was captured."""
        n, width = inputs.rows, inputs.width
        self.tables[:n, :width].copy_(table_rows.view(n, width))
        self.steps += 1
        graph = self.graphs.get(inputs.size)
        if graph is not None:
            graph[0].replay()
            self.replays += 1
            (fed, logits), consumed = graph[1], graph[2]
        else:
            fed, logits, consumed = self._run(inputs.size, inputs.max_context_len)
        return fed[:n], logits[:n], consumed

    def mirror_slots(self, inputs: DecodeInputs) -> torch.Tensor:
        return self.views[inputs.size][5][:inputs.rows]


@contextlib.contextmanager
def _no_collection() -> Iterator[None]:
    """No cyclic garbage collection while graphs are captured: a collection could free a dead engine's
    graphs, and destroying a graph while a stream captures (global capture mode) invalidates the capture.
    What is already garbage is collected first."""
    gc.collect()
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()
