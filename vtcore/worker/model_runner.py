"""The model runner: owns the model, its KV cache and the async device mirror.

One runner serves the sync and the async engine; they differ only in how many submitted steps
may be in flight (the engine's queue depth). A step runs in four phases, as the methods of that
name: ``prepare_inputs`` (host: the batch's ids, positions, KV slots and tables, staged for one
upload), ``run_model`` (device: upload, combine, forward under the override scope), ``sample``
(device: tokens into the mirror, copies to the host started) and ``publish`` (host: wait for the
copies, hand back a ``StepOutput``). ``submit`` does the first and enqueues the next two;
``StepHandle.result`` does the last.

The async device mirror:
1. the sampler writes each sampling request's token into ``last_sampled_tokens[mirror_slot]``,
   a device tensor with one stable slot per running request;
2. a decode row whose token is still in flight carries the host placeholder -1; before the
   forward, the combine gathers ``last_sampled_tokens`` into the step's device input ids, ordered
   after the previous step because all device work is on one stream (CPU: one worker thread);
3. the forward runs inside the device-token override scope, so EmbedInto embeds the combined
   device ids; the scope is told the host ids are stale, so a model that bypasses the override
   fails instead of embedding placeholders;
4. sampled tokens reach the host by non-blocking copies into pinned memory completed on an event;
   the engine waits on it only when it processes that step, one step later;
5. host staging (:mod:`vtcore.worker.staging`): each in-flight step owns one of ``depth`` pinned
   buffers, refilled only after its step retired.
Pure-decode steps, steps of one prefill chunk alone (up to 2048 tokens, no state snapshot inside it;
for models whose stateful layers all declare ``supports_chunk_graphs``) and the verify steps of
speculative decoding (for models whose stateful layers all declare ``supports_verify_graphs``) take the
padded path of
:mod:`vtcore.worker.decode_graphs` (CUDA graphs on CUDA).

``on_submit`` callbacks see every batch before its preparation and after its enqueue (host time
measurements: ``vtcore bench``); ``scope`` (the device-token override scope, after the plugins'
``vtcore_device_token_scope``) and ``decode_graphs`` (None: every step eager) are the seams the
conformance gate's probes use (:mod:`vtcore.testing.runner_probes`).
"""
from __future__ import annotations

import functools
import gc
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Callable, Sequence

import attrs
import torch
from torch import nn

from vtcore.family import ModelFamily
from vtcore.layers import parallel as tp
from vtcore.layers.attention import Attention, AttentionMetadata, set_attention_metadata
from vtcore.layers.embedding import device_token_scope
from vtcore.layers.state import StatefulLayer, copy_states, stateful_layers
from vtcore.plugins.manager import get_plugins
from vtcore.worker.decode_graphs import (CHUNK_SIZES, PLACEHOLDER, DecodeGraphs, DecodeInputs, PaddedForward,
                                         PaddedOutputs)
from vtcore.worker.drafter_graphs import DrafterGraphs
from vtcore.worker.drafting import DraftRows, draft_rows, draft_state_slot, resume_slots
from vtcore.worker.mtp import MTPDrafter
from vtcore.worker.ngram import DeviceNgram
from vtcore.worker.sampler import SampleMeta, Sampler, prompt_logprobs, to_device
from vtcore.worker.staging import Staged, Staging
from vtcore.worker.step import COUNTING_MAX, DEVICE_DRAFT, Batch, Scheduled, StepOutput, int64_range, kv_slots
from vtcore.worker.tensor_parallel import PaddedStep, Peers, StepMessage

CPU_KV_BYTES = 1 << 30  # the KV budget on CPU when num_kv_blocks is not given
#: state snapshots (prefix caching of stateful layers) when num_state_snapshots is not given: as many
#: as this share of the memory budget holds, at most enough for every running request's longest context
SNAPSHOT_SHARE = 0.1
#: CUDA events a runner records its steps' ends with, in turn (``ModelRunner._record``)
EVENT_RING = 8

__all__ = ["ModelRunner", "RunnerConfig", "StepHandle", "StepOutput", "PLACEHOLDER"]


@attrs.define
class RunnerConfig:
    """What the runner needs of the engine's configuration (resolved: a device, a dtype, lengths)."""

    vocab_size: int
    device: torch.device
    dtype: torch.dtype
    block_size: int
    num_kv_blocks: int | None
    gpu_memory_utilization: float
    max_model_len: int
    max_num_seqs: int
    eos_token_ids: Sequence[int]
    seed: int
    depth: int = 1
    enforce_eager: bool = False
    prefix_caching: bool = False
    num_state_snapshots: int | None = None
    state_snapshot_interval: int = 512
    num_speculative_tokens: int = 0
    max_num_batched_tokens: int | None = None  # None: max_model_len
    mtp: bool = False  # ``model.mtp`` (its MTP head, or a draft model) drafts on the device (``vtcore.worker.mtp``)
    tensor_parallel_size: int = 1  # ranks of the model (``vtcore.worker.tensor_parallel``); this runner is one
    ngram: tuple[int, int] | None = None  # (min_n, max_n): the n-gram drafts on the device (``vtcore.worker.ngram``)


@attrs.define
class StepInputs:
    """A prepared general step (any mix of prefill chunks and decode rows) on the host."""

    staged: Staged
    metas: list[SampleMeta]
    sampling: Any
    plp: list[tuple[Any, int, int, int]]  # (request, first row, first position, count) of prompt logprobs
    max_blocks: int
    max_query_len: int
    max_context_len: int
    num_seqs: int
    state: "StateRows"
    stale: bool
    drafts: DraftRows | None = None


@attrs.frozen
class Forward:
    """What ``run_model`` leaves for the phases after it (device tensors); a padded step the same for the
    device drafter (``_drafter_forward``)."""

    hidden: torch.Tensor  # [rows, H], after the final norm
    input_ids: torch.Tensor  # the fed ids, in-flight tokens combined in
    consumed: bool  # whether EmbedInto consumed the device-token override
    sample_rows: torch.Tensor
    sample_slots: torch.Tensor  # the sampling rows' mirror slots
    metadata: AttentionMetadata
    positions: torch.Tensor
    draft_sections: list[torch.Tensor]  # the device views of ``StepInputs.drafts``'s sections, if any
    end_saves: list[tuple[int, int]] = attrs.Factory(list)  # ``StateRows.end_saves``: copies after the forward
    #: a padded step's MTP head or draft model at the step's shapes (``DrafterGraphs.propose`` but the sampled
    #: tokens); None: ``MTPDrafter.propose``
    padded_drafter: Callable[[torch.Tensor | None], tuple[torch.Tensor, torch.Tensor]] | None = None


@attrs.define
class Floating:
    """A step's floating shares (``Scheduled.floats``) as host sections: per share its row in the block
    table, its mirror slot and the draft length of the verify row it floats over; per row of theirs the
    row and its share's index in those."""

    seqs: list[int] = attrs.Factory(list)
    mirror: list[int] = attrs.Factory(list)
    widths: list[int] = attrs.Factory(list)
    rows: list[int] = attrs.Factory(list)
    of: list[int] = attrs.Factory(list)

    def add(self, seq: int, mirror_slot: int, width: int, row0: int, n: int) -> None:
        self.rows += range(row0, row0 + n)
        self.of += [len(self.seqs)] * n
        self.seqs.append(seq)
        self.mirror.append(mirror_slot)
        self.widths.append(width)

    def sections(self) -> list[list[int]]:
        return [self.seqs, self.mirror, self.widths, self.rows, self.of]


FLOATING_SECTIONS = len(attrs.fields(Floating))


@attrs.define
class StateRows:
    """The host lists stateful layers read (``AttentionMetadata``), and the snapshot copies around the
    forward; slots are read at preparation: by the time the device work runs, the host may have moved on."""

    seq_rows: list[tuple[int, int]] = attrs.Factory(list)
    state_slots: list[int] = attrs.Factory(list)
    state_out_slots: list[int] = attrs.Factory(list)
    has_state: list[bool] = attrs.Factory(list)
    restores: list[tuple[int, int]] = attrs.Factory(list)  # (state slot, snapshot slot): copied before
    end_saves: list[tuple[int, int]] = attrs.Factory(list)  # (snapshot slot, state slot): copied after


class StepHandle:
    """A submitted step; ``result()`` waits for its tokens (once) and retires its staging buffer.

    A step with late rows (constrained rows whose mask needed a token still in flight, see
    :mod:`vtcore.worker.sampler`) draws them in ``draw_late()`` once their masks exist (the engine
    calls it after applying each earlier step); ``result()`` waits for that draw."""

    def __init__(self, runner: "ModelRunner", step: int, staging_index: int, wait: Callable[[], StepOutput],
                 late: Callable[[bool], Callable[[], StepOutput] | None] | None = None) -> None:
        self.runner, self.step, self.staging_index, self._wait = runner, step, staging_index, wait
        self._late = late
        self._result: StepOutput | None = None

    def draw_late(self, force: bool = False) -> None:
        """Enqueue the late rows' draw once every one of them can be masked (``force``: now)."""
        if self._late is not None:
            wait = self._late(force)
            if wait is not None:
                self._wait, self._late = wait, None

    def result(self) -> StepOutput:
        if self._result is None:
            try:
                self.draw_late(force=True)
                self._result = self._wait()
            finally:  # a step that failed holds its staging buffer no longer
                self.runner.staging.retire(self.staging_index)
        return self._result

    def discard(self) -> None:
        """Give the step up (the engine dropped its requests after a failure): once its work is done
        (the worker thread or the device may still read the staging buffer), the buffer is free."""
        if self._result is None:
            try:
                self._wait()
            except Exception:  # noqa: BLE001 - it read the tokens of the step that failed; its outcome is moot
                pass
            finally:
                self.runner.staging.retire(self.staging_index)


class ModelRunner:
    def __init__(self, model: nn.Module, family: ModelFamily, config: RunnerConfig) -> None:
        self.model, self.family, self.config = model, family, config
        self.device, self.dtype, self.block_size, self.vocab_size = (config.device, config.dtype, config.block_size,
                                                                      config.vocab_size)
        self.depth = config.depth
        self.cuda = self.device.type == "cuda"
        self.attention_layers = [m for m in model.modules() if isinstance(m, Attention)]
        self.stateful_layers = stateful_layers(model)
        # a state slot per running request (its mirror slot), the dummy, then the prefix-cache snapshots
        self.snapshot_base = config.max_num_seqs + 1
        self.num_state_snapshots = self._snapshot_slots(config)
        # speculative decoding: a running request's state after its fed token and each draft token but the
        # last (that one ends in its own slot), so a verify row can resume from its last accepted token
        self.draft_state_base = self.snapshot_base + self.num_state_snapshots
        self.draft_states = config.num_speculative_tokens
        chain_base = self.draft_state_base + config.max_num_seqs * self.draft_states
        # a stateful draft model's layers (drafting on the device, ``model.mtp``): one more slot a running
        # request, where its chain runs (``MTPDrafter``)
        head = {id(m) for m in stateful_layers(model.mtp)} if config.mtp else set()
        for layer in self.stateful_layers:  # (chains: the dummy slot's too, a padded step's padded requests')
            layer.allocate_state(chain_base + (config.max_num_seqs + 1 if id(layer) in head else 0), self.device)
        self.target_stateful = [m for m in self.stateful_layers if id(m) not in head]
        self.num_kv_blocks = config.num_kv_blocks or self._auto_blocks(config.gpu_memory_utilization,
                                                                       config.max_model_len * config.max_num_seqs)
        self._allocate_kv_cache()
        self.sampler = Sampler(self.vocab_size, self.device, config.eos_token_ids, config.seed)
        self.scope = get_plugins().pm.hook.vtcore_device_token_scope(family=family, scope=device_token_scope) \
            or device_token_scope
        # one slot per running request, and a dummy slot (the last) that padded decode rows name
        self.dummy_slot = config.max_num_seqs
        # the tokens the combine reads on the device: the mirror, then (drafting on the device) per slot the
        # drafter's latest draft (a slot never drafted: 0)
        slots, per_slot = config.max_num_seqs + 1, max(config.num_speculative_tokens, 1)
        self.device_tokens = torch.zeros(slots * (1 + per_slot), dtype=torch.int64, device=self.device)
        self.last_sampled_tokens = self.device_tokens[:slots]
        self.last_sampled_tokens.fill_(PLACEHOLDER)
        self.device_drafts = self.device_tokens[slots:].view(slots, per_slot)
        self.staging = Staging(self.depth, self.device)
        # events after steps' device work, recorded in turn: one re-recorded before its step's wait makes that
        # wait longer, never wrong, and a new event a step costs the host a creation each time
        self._events = [torch.cuda.Event() for _ in range(EVENT_RING)] if self.cuda else []
        self._event_turn = 0
        self._worker = ThreadPoolExecutor(1, "vtcore-forward") if self.depth > 1 and not self.cuda else None
        self.steps_submitted = 0
        self.consuming_forwards = 0  # forwards in which EmbedInto consumed the device-token override
        self.stale_forwards = 0  # forwards whose host ids held placeholders (each must consume the override)
        self.late_draws = 0  # steps whose constrained rows were drawn late (vtcore.worker.sampler)
        self.on_submit: list[Callable[[Batch, bool], None]] = []  # (batch, done): before, then after each submit
        # MTP drafting (an MTP head, or a draft model as ``model.mtp``): the head runs after every step, over its
        # rows; the block tables reach the drafter's lookahead past a step's last position, where its chain writes
        self.mtp = MTPDrafter(model, config.num_speculative_tokens, self.block_size, config.max_model_len,
                              self.draft_state_base, chain_base) if config.mtp else None
        self.ngram = None if config.ngram is None or tp.tp().rank else DeviceNgram(  # (rank 0 drafts)
            *config.ngram, config.num_speculative_tokens, config.max_num_seqs, config.max_model_len, self.device)
        self.lookahead = self.mtp.lookahead if self.mtp is not None else 0
        # the device side of drafting there (``Scheduled.floats``): per running request the draft tokens its
        # last verify row accepted and the head's latest draft; the mirror holds its last accepted token
        self.accepted = torch.zeros(config.max_num_seqs + 1, dtype=torch.int64, device=self.device)
        #: rank 0 of several: the worker ranks its steps are sent to (set by the engine); the ranks' group
        self.peers: Peers | None = None
        self.tp_group = tp.tp()
        self.decode_graphs: DecodeGraphs | None = None
        # a module that must read host values to decode (a stateful layer without device-indexed
        # decode, W4A4 experts) keeps the model eager; a device drafter (the n-gram, an MTP head, a draft
        # model) drafts after a padded step's forward as after a general step
        drafts = (slots, per_slot)
        if not config.enforce_eager and all(
                getattr(m, "supports_decode_graphs", True) for m in model.modules()):
            self.decode_graphs = DecodeGraphs(self._decode_forward, self.device, self.block_size,
                                              config.max_model_len, config.max_num_seqs, self.dummy_slot,
                                              drafts=drafts)
        # verify rows padded to k + 1 tokens (stateful layers that can: the state after each token to its slot)
        self.verify_graphs: DecodeGraphs | None = None
        if self.decode_graphs is not None and config.num_speculative_tokens and all(
                m.supports_verify_graphs for m in self.stateful_layers):
            self.verify_graphs = DecodeGraphs(self._decode_forward, self.device, self.block_size,
                                              config.max_model_len, config.max_num_seqs, self.dummy_slot,
                                              query_len=config.num_speculative_tokens + 1, drafts=drafts,
                                              state_out=self._verify_state_slots if self.stateful_layers else None)
        # a step that is one prefill chunk alone, padded to the next bucket (stateful layers that can: their
        # state from device tensors too); the smallest bucket is asked first, a prompt's first chunk first
        # by the bucket's from-zero graphs (``AttentionMetadata.from_zero``)
        self.chunk_graphs: list[DecodeGraphs] = []
        if self.decode_graphs is not None and all(m.supports_chunk_graphs for m in self.stateful_layers):
            longest = min(config.max_num_batched_tokens or config.max_model_len, config.max_model_len)
            self.chunk_graphs = [DecodeGraphs(self._decode_forward, self.device, self.block_size, config.max_model_len,
                                              1, self.dummy_slot, query_len=q, chunk=True, drafts=drafts,
                                              from_zero=from_zero)
                                 for q in CHUNK_SIZES if q <= longest for from_zero in (True, False)]
            # the counting table a chunk's positions and KV slots are slices of, built now rather than at the first
            # chunk that reaches a high block (8 bytes a KV slot)
            int64_range(0, min(max(self.num_kv_blocks * self.block_size, config.max_model_len), COUNTING_MAX))
        # an MTP head or a draft model after each padded path's steps, at their shapes (graphs on CUDA)
        self.drafter_graphs = {i: DrafterGraphs(self.mtp, g, self.dummy_slot)
                               for i, g in enumerate(self._padded)} if self.mtp is not None else {}
        if config.tensor_parallel_size == 1:  # ranks capture once every rank has built its model
            self.capture_graphs()

    def capture_graphs(self) -> None:
        """On CUDA, capture the padded steps' graphs: decode, verify, then the chunks largest first (each
        followed by its drafter's), each set sharing the memory pool of those before it."""
        if not self.cuda:
            return
        pool = None
        for graphs in [g for g in (self.decode_graphs, self.verify_graphs) if g is not None] + self.chunk_graphs[::-1]:
            pool = graphs.capture(pool)
            drafter = self.drafter_graphs.get(self._padded.index(graphs))
            if drafter is not None:
                pool = drafter.capture(pool)

    # ------------------------------------------------------------------ padded decode counters
    @property
    def graph_sizes(self) -> list[int]:
        """The padded decode batch sizes (empty: every step eager)."""
        return self.decode_graphs.sizes if self.decode_graphs else []

    @property
    def _padded(self) -> list[DecodeGraphs]:
        """Every padded path, in the order a step is offered to them."""
        return [g for g in (self.decode_graphs, self.verify_graphs) if g is not None] + self.chunk_graphs

    @property
    def padded_verify_steps(self) -> int:
        """Verify steps (speculative decoding) run on the padded path."""
        return self.verify_graphs.steps if self.verify_graphs else 0

    @property
    def padded_chunk_steps(self) -> int:
        """Steps of one prefill chunk alone run on the padded path."""
        return sum(g.steps for g in self.chunk_graphs)

    @property
    def padded_decode_steps(self) -> int:
        """Decode and verify steps run on the padded path."""
        return sum(g.steps for g in self._padded if not g.chunk)

    @property
    def graph_replays(self) -> int:
        return sum(g.replays for g in self._padded)

    @property
    def drafter_graph_replays(self) -> int:
        """Steps whose MTP head or draft model replayed a graph (``vtcore.worker.drafter_graphs``)."""
        return sum(g.replays for g in self.drafter_graphs.values())

    def reset_counters(self) -> None:
        """Zero the path counters (padded steps, replays, overridden and late-drawn steps) that checks read
        after their own requests (the engine's warm-up leaves none of its own)."""
        self.consuming_forwards = self.stale_forwards = self.late_draws = 0
        for g in self._padded:
            g.steps = g.replays = 0
        for d in self.drafter_graphs.values():
            d.replays = 0

    @property
    def captured_graphs(self) -> int:
        return sum(len(g.graphs) for g in [*self._padded, *self.drafter_graphs.values()])

    # ------------------------------------------------------------------ memory
    def _bytes_per_block(self) -> int:
        per_token = sum(2 * a.num_kv_heads * a.head_dim for a in self.attention_layers)
        return per_token * self.block_size * torch.empty((), dtype=self.dtype).element_size()

    def _memory_budget(self, utilization: float) -> int:
        """Bytes the caches may take: what ``utilization`` leaves on CUDA, ``CPU_KV_BYTES`` on CPU. On CUDA
        an engine dropped earlier in this process is collected first: its weights, caches and graphs sit
        in reference cycles that only the garbage collector frees."""
        if self.device.type == "cuda":
            gc.collect()
            torch.cuda.empty_cache()
            free, total = torch.cuda.mem_get_info(self.device)
            return int(total * utilization) - (total - free)
        return CPU_KV_BYTES

    def _auto_blocks(self, utilization: float, max_tokens: int) -> int:
        per_block = max(self._bytes_per_block(), 1)
        wanted = -(-max_tokens // self.block_size)
        budget = self._memory_budget(utilization)
        if self.device.type == "cuda":
            if budget < per_block:
                free, total = torch.cuda.mem_get_info(self.device)
                raise RuntimeError(f"gpu_memory_utilization={utilization}: leaves no memory for the KV cache "
                                   f"({free / 2**30:.1f} GiB free of {total / 2**30:.1f} GiB)")
            return min(budget // per_block, wanted)
        return max(1, min(budget // per_block, wanted))

    def _snapshot_slots(self, config: RunnerConfig) -> int:
        """State snapshot slots for prefix caching: none without it, or when a stateful layer cannot
        snapshot (``StatefulLayer.supports_state_snapshots``); else the configured number or what
        ``SNAPSHOT_SHARE`` of the memory budget holds, at most one per ``state_snapshot_interval`` tokens
        of every running request's longest context."""
        layers = self.stateful_layers
        if not (config.prefix_caching and layers and all(m.supports_state_snapshots for m in layers)):
            return 0
        if config.num_state_snapshots is not None:
            return config.num_state_snapshots
        per = max(sum(m.state_bytes() for m in layers), 1)
        enough = config.max_num_seqs * -(-config.max_model_len // config.state_snapshot_interval)
        return max(0, min(enough, int(self._memory_budget(config.gpu_memory_utilization) * SNAPSHOT_SHARE) // per))

    def _copy_states(self, pairs: list[tuple[int, int]], layers: list[StatefulLayer] | None = None) -> None:
        """``state[dst] = state[src]`` in every stateful layer (or ``layers``), for each (dst, src) slot pair
        (device work)."""
        for dst, src in pairs:
            copy_states(self.stateful_layers if layers is None else layers, dst, src)

    def _allocate_kv_cache(self) -> None:
        slots = self.num_kv_blocks * self.block_size
        for layer in self.attention_layers:
            shape = (slots, layer.num_kv_heads, layer.head_dim)
            layer.k_cache = torch.zeros(shape, dtype=self.dtype, device=self.device)
            layer.v_cache = torch.zeros(shape, dtype=self.dtype, device=self.device)
            layer.block_size = self.block_size

    def _to_host(self, t: torch.Tensor) -> torch.Tensor:
        if not self.cuda:
            return t
        host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
        host.copy_(t, non_blocking=True)
        return host

    def _results_to_host(self, out: dict[str, Any], sampled: dict[str, torch.Tensor]) -> None:
        """Start the copies of a step's sampled results to the host, into ``out``: the tokens into the step's
        staging buffer's token row (``Staging.host_tokens``; on the CPU too, a copy of a row's few ids, so
        that the CPU's async runs hold the rows to their steps as CUDA's do), the rest (logprobs) into new
        pinned tensors."""
        for k, v in sampled.items():
            if k == "tokens":
                out[k] = self.staging.host_tokens(out["staging"], v.numel()).copy_(v, non_blocking=True)
            else:
                out[k] = self._to_host(v)

    # ------------------------------------------------------------------ a step
    def submit(self, batch: Batch) -> StepHandle:
        """Prepare ``batch`` on the host and enqueue its device work; returns without waiting for it.
        If that raises, the step holds no staging buffer."""
        for callback in self.on_submit:
            callback(batch, False)
        step = self.steps_submitted
        try:
            graphs = next((g for g in self._padded if g.takes(batch)), None)
            if graphs is not None:
                handle = self._submit_decode(batch, step, graphs)
            else:
                handle = self._submit_general(batch, step)
        except BaseException:
            self.staging.release(step)
            raise
        finally:
            for callback in self.on_submit:
                callback(batch, True)
        return handle

    def _submit_general(self, batch: Batch, step: int) -> StepHandle:
        inputs = self.prepare_inputs(batch, step)
        if self.peers is not None:
            self.peers.send(StepMessage(inputs.staged, inputs.num_seqs, inputs.max_blocks, inputs.max_query_len,
                                        inputs.max_context_len, inputs.state, inputs.stale, bool(inputs.metas),
                                        [(row0, count) for _, row0, _, count in inputs.plp],
                                        inputs.drafts.width if self.mtp is not None else None))
        self.steps_submitted += 1

        def device_work() -> dict[str, Any]:
            f = self.run_model(inputs)
            hidden = f.hidden
            out: dict[str, Any] = {"consumed": f.consumed, "stale": inputs.stale, "plp": {},
                                   "staging": inputs.staged.index}
            with torch.inference_mode():
                tokens = f.sample_rows  # (empty: no row samples)
                if inputs.metas:
                    logits = self.model.compute_logits(hidden[f.sample_rows]).float()
                    tokens = self.sample(out, logits, inputs.sampling, f.input_ids[f.sample_rows], f.sample_slots)
                if inputs.drafts is not None:  # (an MTP head: its KV for every row) the drafts
                    self._draft(out, f, tokens, inputs.drafts.width, inputs.max_context_len)
                for req, row0, start, count in inputs.plp:
                    logits = self.model.compute_logits(hidden[row0:row0 + count])
                    targets = to_device(req.token_ids[start + 1:start + 1 + count], torch.int64, self.device)
                    out["plp"][req.request_id] = {k: self._to_host(v) for k, v in prompt_logprobs(
                        logits, targets, req.params.prompt_logprobs).items()}
            return out

        return self._enqueue(step, inputs.staged.index, device_work, [inputs.metas[i] for i in inputs.sampling.late])

    def _draft(self, out: dict[str, Any], f: "Forward", tokens: torch.Tensor, width: int, max_context_len: int
               ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Run the device drafter (an MTP head, the device n-gram) after a general step; keep, per sampling
        request, its draft, its verify row's accepted count and its last accepted token on the device (the
        next step's floating rows read them, ``Scheduled.floats``) and start their copies to the host. (With
        late rows ``tokens`` holds their first, greedy draws: constrained requests take no drafts, and their
        draw fixes the mirror.) Returns the drafts and accepted counts (device), or None when no row samples."""
        if self.mtp is not None:
            drafts, accepted = self._mtp_propose(f, tokens, width)
        else:
            drafts, accepted = self.ngram.propose(f.input_ids, f.positions, tokens, f.draft_sections, width,
                                                  max_context_len)
        if not accepted.numel():
            return None
        first = f.draft_sections[2]
        slots = f.sample_slots[first]
        if width:  # (no verify row: the sampler's mirror write stands, and no share floats over this step)
            self.last_sampled_tokens[slots] = tokens[first + accepted]
            self.accepted[slots] = accepted
        self.device_drafts[slots] = drafts
        out["drafts"], out["accepted"] = self._to_host(drafts), self._to_host(accepted)
        return drafts, accepted

    def _mtp_propose(self, f: Forward, tokens: torch.Tensor | None, width: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The MTP head's or draft model's drafts and accepted counts after step ``f`` (``tokens``: its sampled
        tokens; a tensor-parallel worker: None)."""
        if f.padded_drafter is not None:
            return f.padded_drafter(tokens)
        return self.mtp.propose(f.hidden, f.metadata, f.positions, f.input_ids, tokens, f.sample_rows,
                                f.draft_sections, width, f.end_saves)

    def prepare_inputs(self, batch: Batch, step: int) -> StepInputs:
        """Phase 1 (host): the flat rows of every scheduled request, staged for one upload."""
        bs = self.block_size
        ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        combine_rows: list[int] = []
        combine_slots: list[int] = []
        sample_rows: list[int] = []
        metas: list[SampleMeta] = []
        plp: list[tuple[Any, int, int, int]] = []
        device_rows: list[int] = []  # draft rows whose tokens come from the device's drafts, and their index there
        device_index: list[int] = []
        floating = Floating()
        max_ctx = max(s.start + s.num_tokens + s.floats for s in batch)
        max_blocks = -(-(max_ctx + self.lookahead) // bs)
        block_table: list[int] = []
        context_lens: list[int] = []
        query_start: list[int] = [0]
        state = StateRows()
        for s in batch:
            req, start, n = s.request, s.start, s.num_tokens
            row0 = len(ids)
            fed = n - len(s.draft)  # the share's own tokens; the draft follows them
            known = [] if s.floats else req.token_ids[start:start + fed]  # floating: its last accepted token
            if len(known) < fed:  # the in-flight token: filled on the device by the combine
                combine_rows.append(row0 + len(known))
                combine_slots.append(req.mirror_slot)
                known = known + [PLACEHOLDER]
            ids += known
            ids += s.draft
            for i, token in enumerate(s.draft):
                if token == DEVICE_DRAFT:
                    device_rows.append(row0 + fed + i)
                    device_index.append(req.mirror_slot * self.device_drafts.shape[1] + i)
            if s.floats:
                floating.add(len(context_lens), req.mirror_slot, s.floats, row0, n)
            pos = range(start, start + n)
            positions += pos
            slots += kv_slots(req.block_ids, bs, start, start + n)
            table = req.block_ids[:max_blocks]
            block_table += table + [0] * (max_blocks - len(table))
            context_lens.append(start + n)
            query_start.append(row0 + n)
            if self.stateful_layers:  # segments, restores and snapshots exist only for their state
                self._state_rows(state, s, row0)
            sample_rows += range(row0 + fed - 1, row0 + fed - 1 + s.num_sampled)
            metas += _sample_metas(s)
            if req.prompt_logprobs is not None:
                # Rows predicting prompt tokens 1..P-1 not yet asked for; a recompute after
                # preemption (or an in-flight earlier chunk) must not ask twice.
                first = max(start, req.prompt_logprobs_scheduled - 1)
                last = min(start + n, req.num_prompt_tokens - 1)
                if last > first:
                    plp.append((req, row0 + first - start, first, last - first))
                    req.prompt_logprobs_scheduled = last + 1
        sample_slots = [m.request.mirror_slot for m in metas]
        drafting = None
        if self.mtp is not None or self.ngram is not None:
            drafting = draft_rows(batch, bs)
            if self.ngram is not None:
                self.ngram.known(batch, drafting)
        sections = [ids, positions, slots, block_table, context_lens, query_start, combine_rows, combine_slots,
                    sample_rows, sample_slots, device_rows, device_index] + floating.sections()
        staged = self.staging.stage(step, sections + (drafting.sections() if drafting else []))
        return StepInputs(staged, metas, self.sampler.prepare(metas), plp, max_blocks,
                          max(s.num_tokens for s in batch), max_ctx, len(batch), state,
                          bool(combine_rows or device_rows), drafting)

    def _verify_state_slots(self, mirror_slot: int, tokens: int) -> list[int]:
        """Where a verify row of ``tokens`` tokens leaves the state after each: the request's draft-state
        slots, the last in its own slot (as ``_state_rows`` lays the general step's segments out)."""
        return [self.draft_state_slot(mirror_slot, i) for i in range(tokens - 1)] + [mirror_slot]

    def draft_state_slot(self, mirror_slot: int, accepted: int) -> int:
        """The state slot holding a verify row's state after its fed token and ``accepted`` draft tokens
        (fewer than its draft's length)."""
        return draft_state_slot(self.draft_state_base, self.draft_states, mirror_slot, accepted)

    def _state_rows(self, state: StateRows, s: Scheduled, row0: int) -> None:
        """``s``'s rows for stateful layers: one segment, split after each snapshot inside it (the first
        part writes the snapshot slot, the rest continues from it); a verify row's draft tokens one
        segment each, every state but the last kept in the request's draft-state slots. A snapshot at
        the fed tokens' end and a restore are copies around the forward."""
        live, base, k = s.request.mirror_slot, self.snapshot_base, len(s.draft)
        n = s.num_tokens - k
        if s.restore >= 0:
            state.restores.append((live, base + s.restore))
        if s.resume >= 0:
            state.restores.append((live, self.draft_state_slot(live, s.resume)))
        fed_end = self.draft_state_slot(live, 0) if k else live
        first, slot, continues = row0, live, s.start > 0
        for consumed, snapshot in s.saves:
            if consumed == n:
                state.end_saves.append((base + snapshot, fed_end))
                continue
            self._segment(state, first, row0 + consumed - first, slot, base + snapshot, continues)
            first, slot, continues = row0 + consumed, base + snapshot, True
        self._segment(state, first, row0 + n - first, slot, fed_end, continues)
        for i in range(1, k + 1):
            out = self.draft_state_slot(live, i) if i < k else live
            self._segment(state, row0 + n - 1 + i, 1, self.draft_state_slot(live, i - 1), out, True)

    @staticmethod
    def _segment(state: StateRows, first: int, count: int, start_slot: int, end_slot: int, continues: bool) -> None:
        state.seq_rows.append((first, count))
        state.state_slots.append(start_slot)
        state.state_out_slots.append(end_slot)
        state.has_state.append(continues)

    def run_model(self, inputs: "StepInputs | StepMessage") -> "Forward":
        """Phase 2 (device): upload, combine the in-flight tokens into the input ids, forward under
        the override scope; reads nothing of the requests (the host may have rescheduled them)."""
        (d_ids, d_pos, d_slots, d_table, d_ctx, d_qstart, d_crows, d_cslots, d_srows, d_sslots, d_drows, d_dindex,
         *rest) = self.staging.upload(inputs.staged)
        floats, drafting = rest[:FLOATING_SECTIONS], rest[FLOATING_SECTIONS:]
        input_ids = d_ids
        if inputs.stale:
            input_ids = d_ids.clone()
            input_ids[d_crows] = self.last_sampled_tokens[d_cslots]
            input_ids[d_drows] = self.device_drafts.view(-1)[d_dindex].clamp(min=0)  # (0: a slot never drafted)
        if self.tp_group.collective:  # rank 0's ids, its in-flight tokens combined in
            tp.broadcast(input_ids, self.tp_group)
        table = d_table.view(inputs.num_seqs, inputs.max_blocks)
        shift: torch.Tensor | None = None
        if floats[0].numel():
            d_pos, d_slots, d_ctx = d_pos.clone(), d_slots.clone(), d_ctx.clone()
            shift = self._float(floats, d_pos, d_slots, d_ctx, table)
        state = inputs.state
        md = AttentionMetadata(
            slot_mapping=d_slots, block_tables=table, context_lens=d_ctx,
            query_start_loc=d_qstart, max_query_len=inputs.max_query_len, max_context_len=inputs.max_context_len,
            seq_rows=state.seq_rows, state_slots=state.state_slots, state_out_slots=state.state_out_slots,
            has_state=state.has_state,  # one sequence from position 0: its context is its rows
            from_zero=inputs.num_seqs == 1 and inputs.max_context_len == inputs.max_query_len)
        set_attention_metadata(md)
        try:
            with torch.inference_mode(), self.scope(input_ids if inputs.stale else None, inputs.stale) as override:
                self._copy_states(state.restores)
                if shift is not None and self.stateful_layers:
                    self._resume_floating(floats, shift)
                hidden = self.model(d_ids, d_pos)
                self._copy_states(state.end_saves, self.target_stateful)  # (a draft's: after its pass)
            consumed = bool(override is not None and override.consumed)
        finally:
            set_attention_metadata(None)
        return Forward(hidden, input_ids, consumed, d_srows, d_sslots, md, d_pos, drafting, state.end_saves)

    def _float(self, floats: list[torch.Tensor], pos: torch.Tensor, slots: torch.Tensor, ctx: torch.Tensor,
               table: torch.Tensor) -> torch.Tensor:
        """Shift the floating shares' positions, KV slots and context lengths (in place) by their requests'
        accepted counts (rank 0's, on every rank); returns the shifts (``Floating``)."""
        seqs, mirror, _, rows, of = floats
        shift = tp.broadcast(self.accepted[mirror], self.tp_group)
        pos[rows] += shift[of]
        at = pos[rows]
        slots[rows] = table[seqs[of], at // self.block_size] * self.block_size + at % self.block_size
        ctx[seqs] += shift
        return shift

    def _resume_floating(self, floats: list[torch.Tensor], shift: torch.Tensor) -> None:
        """A floating share's stateful layers start from the state after its last accepted token: the
        draft-state slot of that count, or their own slot when every draft token was accepted."""
        mirror, widths = floats[1], floats[2]
        copy_states(self.stateful_layers, mirror, resume_slots(self.draft_state_base, self.draft_states, mirror,
                                                               shift, widths))

    def sample(self, out: dict[str, Any], logits: torch.Tensor, sampling: Any, fed: torch.Tensor,
               mirror_slots: torch.Tensor) -> torch.Tensor | None:
        """Phase 3 (device): sample, write the tokens into the device mirror, start their copies to the host
        (a step with late rows keeps their logits and copies once they are drawn: ``_draw_late``). Returns
        the sampled tokens (device; late rows' first, greedy draws)."""
        sampled = self.sampler.sample(logits, sampling, fed)
        self.last_sampled_tokens[mirror_slots] = sampled["tokens"]
        if sampling.late:
            rows = to_device(sampling.late, torch.int64, self.device)
            # (a late row's fed id is read only by its penalties and bad words: ``Sampler.prepare`` edits)
            reads_fed = any(sampling.metas[r].reads_fed for r in sampling.late)
            out["late"] = (sampled, rows, logits[rows], fed[rows] if reads_fed else None, mirror_slots[rows])
        else:
            self._results_to_host(out, sampled)
        return sampled["tokens"]

    def _draw_late(self, out: dict[str, Any], sampling: Any) -> dict[str, Any]:
        """Phase 3, late (device): draw the late rows with their masks over the logits kept for them; write
        their tokens into the mirror and the step's results; start the copies to the host."""
        sampled, rows, logits, fed, mirror_slots = out.pop("late")
        self.late_draws += 1
        with torch.inference_mode():
            drawn = self.sampler.sample(logits, sampling, fed, into=((self.last_sampled_tokens, mirror_slots),
                                                                     (sampled["tokens"], rows)))
            for key in ("logprobs", "ranks"):  # the top logprobs are the raw model's: unchanged
                if key in drawn and key in sampled:
                    sampled[key][rows] = drawn[key]
            self._results_to_host(out, sampled)
        return out

    def publish(self, out: dict[str, Any], event: torch.cuda.Event | None) -> StepOutput:
        """Phase 4 (host): wait for the step's copies and hand back its results."""
        if event is not None:
            event.synchronize()
        self.stale_forwards += out["stale"]
        if out["consumed"] and out["stale"]:
            self.consuming_forwards += 1
        plp = {rid: _plp_entries(t) for rid, t in out["plp"].items()}
        if "tokens" not in out:
            return StepOutput([], None, None, None, None, plp)
        lp = "logprobs" in out
        return StepOutput(out["tokens"].tolist(), out["logprobs"].tolist() if lp else None,
                          out["ranks"].tolist() if lp else None, out["top_ids"].tolist() if lp else None,
                          out["top_logprobs"].tolist() if lp else None, plp,
                          out["drafts"].tolist() if "drafts" in out else None,
                          out["accepted"].tolist() if "accepted" in out else None)

    def _enqueue(self, step: int, index: int, device_work: Callable[[], dict[str, Any]],
                 late: Sequence[SampleMeta] = ()) -> StepHandle:
        """Run ``device_work`` (on the worker thread on CPU at depth > 1) and hand back its handle, whose
        ``draw_late`` draws ``late``, the step's late rows."""
        device_work = self._with_peers(device_work)
        if self._worker is not None:
            future: Future = self._worker.submit(device_work)
            wait: Callable[[], StepOutput] = lambda: self.publish(future.result(), None)
        else:
            out = device_work()
            event = self._record()
            wait = lambda: self.publish(out, event)  # noqa: E731

        def draw_late(force: bool) -> Callable[[], StepOutput] | None:
            if not force and any(m.awaits_mask for m in late):
                return None
            sampling = self.sampler.prepare(list(late), final=True)  # the masks: host work, now
            if self._worker is not None:
                drawn: Future = self._worker.submit(lambda: self._draw_late(future.result(), sampling))
                return lambda: self.publish(drawn.result(), None)
            done, done_event = self._draw_late(out, sampling), self._record()
            return lambda: self.publish(done, done_event)

        return StepHandle(self, step, index, wait, draw_late if late else None)

    def _with_peers(self, device_work: Callable[[], dict[str, Any]]) -> Callable[[], dict[str, Any]]:
        """``device_work`` that, with tensor-parallel workers, names a dead one when it fails, or else ends
        the ranks (``Peers.failed``: the workers may wait in a collective this rank never reaches), Ctrl-C
        included."""
        def work() -> dict[str, Any]:
            try:
                return device_work()
            except BaseException as exc:
                if self.peers is not None:
                    self.peers.check()
                    self.peers.failed(exc)
                raise
        return work

    def _record(self) -> torch.cuda.Event | None:
        """An event after the device work enqueued so far (None on CPU)."""
        if not self.cuda:
            return None
        self._event_turn = (self._event_turn + 1) % len(self._events)
        event = self._events[self._event_turn]
        event.record()
        return event

    # ------------------------------------------------------------------ padded decode
    def _decode_forward(self, ids: torch.Tensor, pos: torch.Tensor, slots: torch.Tensor, ctx: torch.Tensor,
                        combine: torch.Tensor, mirror: torch.Tensor, tables: torch.Tensor, qstart: torch.Tensor,
                        query_len: int, max_context_len: int, last: torch.Tensor | None = None,
                        state_out: torch.Tensor | None = None, from_zero: bool = False) -> PaddedOutputs:
        """The padded forward: combine, model, logits (of the ``last`` rows only, when given; captured in a graph on
        CUDA); ``from_zero``: a chunk from position 0 (``AttentionMetadata.from_zero``). Stateful layers: one
        state a row from its mirror slot; a lone chunk's continues where its first position is past 0 and ends
        after its last real row; a verify row's continues where its first position is past 0, the state after
        each token written to its ``state_out`` slot."""
        fed = torch.where(combine >= 0, self.device_tokens[combine.clamp(min=0)], ids)
        if self.tp_group.collective:  # rank 0's ids, its in-flight tokens combined in
            tp.broadcast(fed, self.tp_group)
        decode, chunk, verify = query_len == 1, last is not None, state_out is not None
        set_attention_metadata(md := AttentionMetadata(
            slot_mapping=slots, block_tables=tables, context_lens=ctx, query_start_loc=qstart,
            max_query_len=query_len, max_context_len=max_context_len,
            state_index=mirror if decode or chunk or verify else None,
            state_continues=pos > 0 if decode else pos[:1] > 0 if chunk else pos[::query_len] > 0 if verify else None,
            state_tokens=last + 1 if chunk else None,
            state_out_index=state_out.view(-1, query_len) if verify else None, from_zero=from_zero))
        try:
            with self.scope(fed, True) as override:
                hidden = self.model(ids, pos)
            consumed = bool(override is not None and override.consumed)
        finally:
            set_attention_metadata(None)
        logits = self.model.compute_logits(hidden if last is None else hidden[last]).float()
        return PaddedOutputs(fed, logits, hidden, md, consumed)

    def _submit_decode(self, batch: Batch, step: int, graphs: DecodeGraphs) -> StepHandle:
        inputs: DecodeInputs = graphs.prepare(batch)
        sections = inputs.sections
        drafting = None
        drafter = self.ngram is not None or self.mtp is not None  # (the n-gram on rank 0 alone; a head on each)
        if drafter or any(s.floats for s in batch):
            floating = Floating()
            for r, s in enumerate(batch):
                if s.floats:
                    floating.add(r, s.request.mirror_slot, s.floats, r * graphs.q, s.num_tokens)
            sections = sections + floating.sections()
            if drafter:
                drafting = draft_rows(batch, self.block_size, graphs.q, inputs.size, self.dummy_slot)
                if self.ngram is not None:
                    self.ngram.known(batch, drafting)
                sections += drafting.sections()
                if self.mtp is not None:  # (``DrafterGraphs``)
                    sections.append(drafting.padded(inputs.size, graphs.q))
        staged = self.staging.stage(step, sections, align=1)
        metas = [m for s in batch for m in _sample_metas(s)]
        sampling = self.sampler.prepare(metas)
        restores: list[tuple[int, int]] = []
        saves: list[tuple[int, int]] = []
        if self.stateful_layers:  # every snapshot is at a row's end (``DecodeGraphs.takes``)
            base = self.snapshot_base
            restores = [(s.request.mirror_slot, base + s.restore) for s in batch if s.restore >= 0]
            restores += [(s.request.mirror_slot, self.draft_state_slot(s.request.mirror_slot, s.resume))
                         for s in batch if s.resume >= 0]
            saves = [(base + snapshot, s.request.mirror_slot) for s in batch for _, snapshot in s.saves]
        padded = PaddedStep(self._padded.index(graphs), inputs, staged, restores, saves,
                            drafting.width if self.mtp is not None else None)
        if self.peers is not None:  # (the sections travel staged)
            self.peers.send(attrs.evolve(padded, inputs=attrs.evolve(inputs, sections=[])))
        self.steps_submitted += 1

        def device_work() -> dict[str, Any]:
            f, draft_sections = self._run_padded(padded)
            out: dict[str, Any] = {"consumed": f.consumed, "stale": inputs.stale, "plp": {}, "staging": staged.index}
            with torch.inference_mode():
                tokens = f.sample_rows  # (empty: a chunk before the prompt's last samples nothing)
                if metas:
                    tokens = self.sample(out, f.logits, sampling, f.fed, f.mirror)
                # (an MTP head's or a draft model's pass writes its KV for every step, sampling or not)
                if drafting is not None and (metas or self.mtp is not None):
                    self._draft(out, self._drafter_forward(padded, f, draft_sections), tokens, drafting.width,
                                inputs.max_context_len)
            return out

        return self._enqueue(step, staged.index, device_work, [metas[i] for i in sampling.late])

    def _run_padded(self, step: "PaddedStep") -> tuple[PaddedForward, list[torch.Tensor]]:
        """A padded step's device side (the same on every rank): upload, restores, floating shares shifted,
        forward, the target's saves (an MTP head's or a draft model's come after its pass: ``end_saves``);
        returns the forward and the drafter's sections."""
        graphs = self._padded[step.graphs]
        sections = self.staging.upload(step.staged, graphs.buffer, into=graphs.num_sections)
        rest = sections[graphs.num_sections:]
        floats, draft_sections = rest[:FLOATING_SECTIONS], rest[FLOATING_SECTIONS:]
        with torch.inference_mode():
            self._copy_states(step.restores)

            def adjust(views: list[torch.Tensor], tables: torch.Tensor) -> None:
                shift = self._float(floats, views[1], views[2], views[3], tables)
                if self.stateful_layers:
                    self._resume_floating(floats, shift)

            f = graphs.run(step.inputs, sections, adjust if floats and floats[0].numel() else None)
            self._copy_states(step.saves, self.target_stateful)
        return f, draft_sections

    def _drafter_forward(self, step: "PaddedStep", f: PaddedForward, draft_sections: list[torch.Tensor]
                         ) -> "Forward":
        """What the device drafter reads of a padded step: the same as of a general step's ``Forward``, and
        an MTP head's or draft model's run at the step's shapes."""
        o = f.outputs
        # a replayed graph's metadata bounds the context by the longest a row can have; eager launches size
        # their grids by the step's own bound
        md = attrs.evolve(o.metadata, max_context_len=step.inputs.max_context_len)
        padded_drafter = None if self.mtp is None else functools.partial(
            self.drafter_graphs[step.graphs].propose, step.inputs.size, draft_sections[1].numel(),
            draft_sections[-1], f.sample_rows, outputs=o, positions=f.positions, md=md, end_saves=step.saves)
        return Forward(o.hidden, o.fed, f.consumed, f.sample_rows, f.mirror, md, f.positions, draft_sections,
                       step.saves, padded_drafter)

    def follow(self, message: "StepMessage | PaddedStep") -> None:
        """A tensor-parallel worker's part of a step rank 0 submitted: the same forward and the same logits
        (their collectives with the other ranks); rank 0 samples."""
        if isinstance(message, PaddedStep):
            padded, draft_sections = self._run_padded(message)
            if message.mtp_width is not None:  # rank 0's sampled tokens arrive inside
                with torch.inference_mode():
                    self._mtp_propose(self._drafter_forward(message, padded, draft_sections), None,
                                      message.mtp_width)
            return
        f = self.run_model(message)
        with torch.inference_mode():
            if message.samples:
                self.model.compute_logits(f.hidden[f.sample_rows])
            if message.mtp_width is not None:  # rank 0's sampled tokens arrive inside
                self._mtp_propose(f, None, message.mtp_width)
            for row0, count in message.plp_rows:
                self.model.compute_logits(f.hidden[row0:row0 + count])

    def shutdown(self) -> None:
        if self._worker is not None:
            self._worker.shutdown(wait=True)
        if self.peers is not None:
            self.peers.shutdown()
            self.peers = None


def _sample_metas(s: Scheduled) -> list[SampleMeta]:
    """What the sampler needs of each token ``s`` samples: after its last fed token, and in a verify row
    after each draft token too (the history then holds the draft tokens before it)."""
    req, fed = s.request, s.num_tokens - len(s.draft)
    end, outputs = s.start + fed, s.start + fed - req.num_prompt_tokens
    if not s.draft:  # (most rows: one sample, after the fed tokens)
        return [SampleMeta(req, end - 1, outputs)] if s.samples else []
    # sample i was fed draft[i - 1] (the first, the share's last token): before it, the share's tokens and the
    # draft tokens before that one
    return [SampleMeta(req, end - 1, outputs)] + [SampleMeta(req, end, outputs + i, s.draft[:i - 1])
                                                  for i in range(1, s.num_sampled)]


def _plp_entries(t: dict[str, torch.Tensor]) -> list[dict[int, tuple[float, int]]]:
    targets, chosen, ranks = t["targets"].tolist(), t["chosen"].tolist(), t["ranks"].tolist()
    top_ids, top_lp = t["top_ids"].tolist(), t["top_logprobs"].tolist()
    out = []
    for row, tok in enumerate(targets):
        entry = {tok: (chosen[row], ranks[row])}
        for rank, (i, v) in enumerate(zip(top_ids[row], top_lp[row]), start=1):
            entry.setdefault(i, (v, rank))
        out.append(entry)
    return out
