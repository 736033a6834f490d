"""Steps padded to fixed shapes, and on CUDA one captured graph per shape.

Each row of a padded step has the same query length q: 1 for pure decode, k + 1 for the verify rows of
speculative decoding (the fed token and k draft slots; a shorter draft is padded), or (``chunk``) a bucket of
up to q tokens for a step that is one prefill chunk alone (its launches, hundreds in an eager forward, cost
the host more than the device spends on a short chunk; logits only at its last real token; a prompt's first
chunk, from position 0, in graphs of its own: ``from_zero``). One flat int64 buffer holds, for padded size P
and T = P * q tokens, six sections (ids [T], positions [T], KV slots [T], context lengths [P], combine slots
[T], mirror slots [P]; chunk: a seventh, each row's last real token [P]), then the real rows' block table,
then (q > 1) the rows that sample and their mirror slots; a step uploads into it with one copy, and the block
table is copied into the persistent table the kernels read. The combine (-1: the host id is current) runs
inside the graph. Padded rows: id 0, position 0, KV slot -1 (never written), context q, no combine, the dummy
mirror slot; their samples are never written to the mirror. A verify row's (or a chunk's) padded tokens: id 0,
the row's first position, KV slot -1; its context length counts them, so each real token sees exactly the keys
before it (the causal rule reads the query length from the uniform query starts), and no real token sees a
padded one. Verify rows of a model with stateful layers have a seventh section, per token the slot its state
is written to (padding: -1, none). On CPU the same padded forward runs eagerly.

Drafts made on the device (``vtcore.worker.drafting``) take these paths too: a draft token the device
holds is combined in like an in-flight token (its combine index points past the mirror, into the
runner's drafts: ``drafts``), and a floating share (``Scheduled.floats``) is laid out at its lagged
position and shifted on the device before the replay (``run``'s ``adjust``). The drafter runs after the
replay over the graph's outputs: every padded token's hidden state and the metadata the forward read (an
MTP head's or a draft model's pass writes its KV at the step's slots, as the target did), in graphs of
its own (``vtcore.worker.drafter_graphs``) or, the device n-gram, eagerly.
"""
from __future__ import annotations

import contextlib
import functools
import gc
from array import array
from typing import Any, Callable, Iterator, TypeVar

import attrs
import torch

from vtcore.layers.attention import AttentionMetadata
from vtcore.worker.step import (COUNTING_MAX, DEVICE_DRAFT, Batch, Scheduled, int64_range, int64s, kv_slot_int64s,
                                kv_slots)

GRAPH_SIZES = (1, 2, 4, 8, *range(16, 257, 16))  # padded decode batch sizes (one CUDA graph each)
GRAPH_MAX = 256  # larger decode batches run eagerly
VERIFY_MAX_TOKENS = 512  # verify steps of more padded tokens run on the general path
CHUNK_SIZES = (16, 32, 64, 128, 256, 512, 1024, 2048)  # padded lengths of a lone prefill chunk
PLACEHOLDER = -1  # the host id of a token still in flight; never a real token
_T = TypeVar("_T")


@attrs.frozen
class PaddedOutputs:
    """What a padded forward leaves (a captured graph's outputs, rewritten by each replay): every padded
    token's fed id (in-flight tokens combined in) and hidden state after the final norm, the float32 logits
    (chunk: of the last rows only), the attention metadata it read (its tensors the step's sections: a
    device drafter's pass over the step's rows reads the same), and whether EmbedInto consumed the
    device-token override."""

    fed: torch.Tensor
    logits: torch.Tensor
    hidden: torch.Tensor
    metadata: AttentionMetadata
    consumed: bool


#: forward(ids, positions, kv slots, context lens, combine slots, mirror slots, block tables, query starts,
#: query len, max_context_len, chunk: last rows or None, verify rows' state out slots or None, from zero) -> its
#: outputs
DecodeForward = Callable[..., PaddedOutputs]


@attrs.define
class DecodeInputs:
    """A padded step on the host: padded size, real rows, block-table width and the sections to stage."""

    size: int
    rows: int
    width: int
    sections: list[list[int]]
    stale: bool  # some row's token is still in flight (filled on the device by the combine)
    max_context_len: int


class DecodeGraphs:
    """The padded steps of query length ``query_len``: 1 (pure decode), k + 1 (verify rows), or with
    ``chunk`` one row of up to ``query_len`` tokens."""

    def __init__(self, forward: DecodeForward, device: torch.device, block_size: int, max_model_len: int,
                 max_num_seqs: int, dummy_slot: int, query_len: int = 1, chunk: bool = False,
                 drafts: tuple[int, int] = (0, 0), state_out: Callable[[int, int], list[int]] | None = None,
                 from_zero: bool = False) -> None:
        self.forward, self.device, self.block_size, self.q = forward, device, block_size, query_len
        self.chunk = chunk
        #: (chunk) only a chunk from position 0, whose attention reads its own K/V (``AttentionMetadata.from_zero``)
        self.from_zero = from_zero
        #: verify rows of a model with stateful layers: (mirror slot, real tokens) -> the slot the state after
        #: each real token is written to (``AttentionMetadata.state_out_index``)
        self.state_out = state_out
        #: (where the device drafts start in the tokens the combine reads, drafts per mirror slot)
        self.drafts = drafts
        q = query_len
        self.per_token = (True, True, True, False, True, False) + ((False,) if chunk else (True,) if state_out else ())
        # a padded row's context counts its q tokens: a context shorter than the query would put the
        # attention's causal range at negative positions (block-table reads before the table)
        self.padding = [0, 0, -1, q, -1, dummy_slot] + ([0] if chunk else [-1] if state_out else [])
        largest = 1 if chunk else min(max_num_seqs, GRAPH_MAX if q == 1 else VERIFY_MAX_TOKENS // q)
        self.sizes = [p for p in GRAPH_SIZES if p < largest] + [largest] if largest else []
        # wide enough for a verify row's padded positions past max_model_len
        self.max_table = -(-(max_model_len + q) // block_size)
        per_row = sum(q if t else 1 for t in self.per_token)
        # after the table: the rows that sample and their mirror slots (verify: every token; chunk: one a row)
        samples = 0 if q == 1 else 2 * (1 if chunk else q)
        #: the sections ``prepare`` makes (per row, the table, the samples); a step's sections after them
        #: are the runner's
        self.num_sections = len(self.per_token) + 1 + (2 if q > 1 else 0)
        self.buffer = torch.zeros((per_row + samples + self.max_table) * largest, dtype=torch.int64, device=device)
        self.tables = torch.zeros(largest, self.max_table, dtype=torch.int32, device=device)
        self.qstart = torch.arange(0, (largest + 1) * q, q, dtype=torch.int32, device=device)
        self._no_combine = int64s(array("q", [-1]) * q)  # (a chunk's combine section: every token on the host)
        # the six sections of padded size p: views fixed once, as the graphs read them
        self.views = {p: self._sections(p) for p in self.sizes}
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, PaddedOutputs]] = {}
        self.steps = self.replays = 0  # padded steps run, and how many of them replayed a graph
        self.pool = None
        # the longest context a padded row can have (a verify row's padding runs past max_model_len)
        self.max_context_len = max_model_len + (q if q > 1 else 0)

    def _sections(self, p: int) -> list[torch.Tensor]:
        lengths = [p * (self.q if per_token else 1) for per_token in self.per_token]
        bounds = [sum(lengths[:i]) for i in range(len(lengths) + 1)]
        return [self.buffer[a:b] for a, b in zip(bounds, bounds[1:])]

    def takes(self, batch: Batch) -> bool:
        """A batch of decode rows (one fed token, sampling) that fits the largest padded size; for q > 1 verify rows,
        each with a draft of at most q - 1 tokens and one with a draft at all; for a chunk, one row of at most
        q tokens and no draft (the caller asks the smallest bucket first; ``from_zero``: its first position 0)
        whose state snapshots, if any, fall at its end (the runner copies them after the forward; one inside
        would split the row's state segment)."""
        if not self.sizes or len(batch) > self.sizes[-1]:
            return False
        if self.chunk:
            s = batch[0]
            return (not s.draft and s.num_tokens <= self.q and all(at == s.num_tokens for at, _ in s.saves)
                    and s.request.prompt_logprobs is None and (not self.from_zero or s.start == s.floats == 0))
        if self.q == 1:
            return all(s.num_tokens == 1 and s.samples for s in batch)
        return any(s.draft for s in batch) and all(
            s.samples and s.num_tokens == 1 + len(s.draft) < self.q + 1 and s.restore < 0 and not s.saves
            and s.request.prompt_logprobs is None for s in batch)

    def padded_size(self, rows: int) -> int:
        """The padded batch size a decode step of ``rows`` rows runs at."""
        return next(size for size in self.sizes if size >= rows)

    def _run(self, p: int, max_context_len: int) -> PaddedOutputs:
        views = self.views[p]
        return self.forward(*views[:6], self.tables[:p], self.qstart[:p + 1], self.q, max_context_len,
                            views[6] if self.chunk else None, views[6] if self.state_out else None, self.from_zero)

    def capture(self, pool: Any = None) -> Any:
        """Capture one CUDA graph per padded size into the memory pool ``pool`` (None: a new one), largest
        first; returns the pool, for the next graphs to share. Tensor-parallel ranks capture their graphs
        (collectives inside) in the same order, after every rank has built its model."""
        if not self.sizes:
            return pool
        with torch.inference_mode(), no_collection():
            for p in reversed(self.sizes):  # largest first: the others reuse its memory pool
                self.pad_rows(p)  # all rows padded: the capture writes no KV
                graph, outputs = capture_graph(functools.partial(self._run, p, self.max_context_len), self.device, pool)
                pool = graph.pool()
                self.graphs[p] = (graph, outputs)
        self.pool = pool
        torch.cuda.synchronize(self.device)
        return pool

    def pad_rows(self, p: int) -> None:
        """Every row of padded size ``p`` a padded row (its sections share the buffer with the other sizes')."""
        for view, pad in zip(self.views[p], self.padding):
            view.fill_(pad)

    def prepare(self, batch: Batch) -> DecodeInputs:
        """The host side of a padded step of ``batch``."""
        if self.q == 1 and not self.chunk:
            return self._prepare_decode(batch)
        s = batch[0]
        if self.chunk and not s.floats and len(s.request.token_ids) >= s.start + s.num_tokens and \
                max(s.start + self.q, (max(s.request.block_ids) + 1) * self.block_size) <= COUNTING_MAX:
            return self._prepare_chunk(s)
        return self._prepare_rows(batch)

    def _prepare_decode(self, batch: Batch) -> DecodeInputs:
        """``_prepare_rows`` for q = 1 (every row one fed token, no draft): the same sections, one value a
        row appended to each, without the general layout's per-row lists, which dominated a large decode
        batch's submit (docs/BENCHMARKS.md)."""
        bs, n = self.block_size, len(batch)
        p = self.padded_size(n)
        width = max(len(s.request.block_ids) for s in batch)
        pad = [0] * width
        cols: list[list[int]] = [[] for _ in self.per_token]
        ids, positions, slots, context, combine, mirror = cols
        table: list[int] = []
        stale = False
        for s in batch:
            req, pos, blocks = s.request, s.start, s.request.block_ids
            if s.floats or len(req.token_ids) <= pos:  # in flight, or floating: the combine fills it in
                ids.append(PLACEHOLDER)
                combine.append(req.mirror_slot)
                stale = True
            else:
                ids.append(req.token_ids[pos])
                combine.append(-1)
            positions.append(pos)
            slots.append(blocks[pos // bs] * bs + pos % bs)
            context.append(pos + 1)
            mirror.append(req.mirror_slot)
            table += blocks
            table += pad[:width - len(blocks)]
        for col, v in zip(cols, self.padding):
            col += [v] * (p - n)
        return DecodeInputs(p, n, width, cols + [table], stale, max(s.start + s.floats for s in batch) + 1)

    def _prepare_chunk(self, s: Scheduled) -> DecodeInputs:
        """``_prepare_rows`` for a chunk whose tokens the host knows (not floating, none in flight): its positions,
        KV slots and combine section as native int64 buffers the staging copies whole, not lists of a Python int
        a token (a long chunk's layout is on the host's path before the device may start)."""
        req, pos, real, q = s.request, s.start, s.num_tokens, self.q
        samples = [0] if s.samples else []
        sections = [req.token_ids[pos:pos + real] + [0] * (q - real),
                    int64s(int64_range(pos, pos + real), array("q", [pos]) * (q - real)),
                    kv_slot_int64s(req.block_ids, self.block_size, pos, pos + real, q), [pos + q], self._no_combine,
                    [req.mirror_slot], [real - 1], req.block_ids, samples, [req.mirror_slot] * len(samples)]
        return DecodeInputs(1, 1, len(req.block_ids), sections, False, pos + q)

    def _prepare_rows(self, batch: Batch) -> DecodeInputs:
        """The host side of a padded step of rows of q tokens (verify rows, a chunk, or decode rows)."""
        bs, n, q = self.block_size, len(batch), self.q
        drafts_at, per_slot = self.drafts
        p = self.padded_size(n)
        width = max(len(s.request.block_ids) for s in batch)
        pad = [0] * width
        table: list[int] = []
        sample_rows: list[int] = []
        mirror: list[int] = []
        stale = False
        cols: list[list[int]] = [[] for _ in self.per_token]
        for r, s in enumerate(batch):
            req, pos, real = s.request, s.start, s.num_tokens
            fed = real - len(s.draft)
            known = [] if s.floats else req.token_ids[pos:pos + fed]  # floating: its last accepted token
            missing = fed - len(known)  # the in-flight token (at most one): filled by the combine
            on_device = [i for i, token in enumerate(s.draft) if token == DEVICE_DRAFT]
            stale |= missing > 0 or bool(on_device)
            cols[0] += known + [PLACEHOLDER] * missing + [*s.draft] + [0] * (q - real)
            cols[1] += [*range(pos, pos + real)] + [pos] * (q - real)
            cols[2] += kv_slots(req.block_ids, bs, pos, pos + real) + [-1] * (q - real)
            cols[3].append(pos + q)
            drafted = [-1] * len(s.draft)
            for i in on_device:
                drafted[i] = drafts_at + req.mirror_slot * per_slot + i
            cols[4] += [-1] * len(known) + [req.mirror_slot] * missing + drafted + [-1] * (q - real)
            cols[5].append(req.mirror_slot)
            if self.chunk:
                cols[6].append(r * q + real - 1)
                sample_rows += [r] if s.samples else []
                mirror += [req.mirror_slot] if s.samples else []
            elif q > 1:  # (a decode step's rows are its sample rows, in mirror order: nothing to send)
                sample_rows += range(r * q, r * q + real)
                mirror += [req.mirror_slot] * real
            if self.state_out is not None:
                cols[6] += self.state_out(req.mirror_slot, real) + [-1] * (q - real)
            table += req.block_ids
            table += pad[:width - len(req.block_ids)]
        for col, v, per_token in zip(cols, self.padding, self.per_token):
            col += [v] * ((p - n) * (q if per_token else 1))
        extra = [sample_rows, mirror] if q > 1 else []
        return DecodeInputs(p, n, width, cols + [table] + extra, stale,
                            max(s.start + s.floats for s in batch) + q)

    def run(self, inputs: DecodeInputs, staged: list[torch.Tensor],
            adjust: Callable[[list[torch.Tensor], torch.Tensor], None] | None = None) -> "PaddedForward":
        """The device side, after the sections were uploaded into ``buffer`` (``staged``: their device
        views): a graph replay where one was captured. ``adjust(sections, block tables)`` runs on the step's
        sections in the buffer once the block tables are in place, before the forward (floating shares)."""
        n, width, table = inputs.rows, inputs.width, len(self.per_token)
        views = self.views[inputs.size]
        self.tables[:n, :width].copy_(staged[table].view(n, width))
        if adjust is not None:
            adjust(views, self.tables)
        self.steps += 1
        graph = self.graphs.get(inputs.size)
        if graph is not None:
            graph[0].replay()
            self.replays += 1
            o = graph[1]
        else:
            o = self._run(inputs.size, inputs.max_context_len)
        fed, logits = o.fed, o.logits
        if self.q == 1:  # (qstart: 0, 1, 2, ...)
            return PaddedForward(fed[:n], logits[:n], views[5][:n], o, views[1], self.qstart[:n])
        rows, mirror = staged[table + 1], staged[table + 2]
        if self.chunk:  # logits of each row's last real token; the fed token there
            last = views[6][rows]
            return PaddedForward(fed[last], logits[rows], mirror, o, views[1], last)
        return PaddedForward(fed[rows], logits[rows], mirror, o, views[1], rows)


@attrs.frozen
class PaddedForward:
    """What a padded step's forward leaves (device tensors): per sampling row its fed id, logits and mirror
    slot; the forward's outputs over every padded token; their (shifted) positions; and the sampling rows'
    indices among those tokens."""

    fed: torch.Tensor
    logits: torch.Tensor
    mirror: torch.Tensor
    outputs: PaddedOutputs
    positions: torch.Tensor
    sample_rows: torch.Tensor

    @property
    def consumed(self) -> bool:
        """Whether EmbedInto consumed the device-token override."""
        return self.outputs.consumed


def capture_graph(run: Callable[[], _T], device: torch.device, pool: Any) -> tuple[torch.cuda.CUDAGraph, _T]:
    """``run`` once eagerly (the warm-up: compiles kernels, sizes workspaces), then captured into a CUDA graph
    in the memory pool ``pool``; returns the graph and the captured call's outputs (rewritten by each replay).
    Called inside ``no_collection``."""
    run()
    torch.cuda.synchronize(device)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool):
        outputs = run()
    return graph, outputs


@contextlib.contextmanager
def no_collection() -> Iterator[None]:
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
