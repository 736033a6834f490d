"""The model runner: owns the model, its KV cache and the async device mirror.

One runner serves the sync and the async engine; they differ only in how many submitted steps
may be in flight (the engine's queue depth). ``submit`` prepares a step on the host and enqueues
its device work; ``StepHandle.result`` waits for that step's tokens on the host.

The async device mirror (see ../shared/ARCHITECTURE.md):
1. the sampler writes each sampling request's token into ``last_sampled_tokens[mirror_slot]``,
   a device tensor with one stable slot per running request;
2. a decode row whose token is still in flight carries the host placeholder -1; before the
   forward, the combine gathers ``last_sampled_tokens`` into the step's device input ids, ordered
   after the previous step because all device work is on one stream (CPU: one worker thread);
3. the forward runs inside the device-token override scope, so EmbedInto embeds the combined
   device ids; the scope is told the host ids are stale, so a model that bypasses the override
   fails instead of embedding placeholders;
4. sampled tokens reach the host by non-blocking copies into pinned memory completed on an event;
   the engine waits on it only when it processes that step, one step later.
5. host staging: each in-flight step owns one of ``depth`` pinned staging buffers; a buffer is
   refilled only after the step that used it has retired (its result was taken), so preparing
   N+1 never rewrites memory that N's upload may still read.
"""
from __future__ import annotations

import os
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Callable, Sequence

import attrs
import torch
from torch import nn

from vtcore.engine.scheduler import Batch
from vtcore.family import ModelFamily
from vtcore.layers.attention import Attention, AttentionMetadata, set_attention_metadata
from vtcore.layers.embedding import device_token_scope
from vtcore.layers.state import StatefulLayer
from vtcore.plugins.manager import get_plugins
from vtcore.worker.sampler import SampleMeta, Sampler, prompt_logprobs, to_device

CPU_KV_BYTES = 1 << 30  # the KV budget on CPU when num_kv_blocks is not given
PLACEHOLDER = -1  # the host id of a token still in flight; never a real token
DECODE_GRAPH_SIZES = (1, 2, 4, 8, *range(16, 257, 16))  # padded decode batch sizes (one CUDA graph each)
DECODE_GRAPH_MAX = 256  # larger decode batches run eagerly


@attrs.define
class StepOutput:
    """One step's results on the host, in the order of the step's sampling requests."""

    token_ids: list[int]
    logprobs: list[float] | None
    ranks: list[int] | None
    top_ids: list[list[int]] | None
    top_logprobs: list[list[float]] | None
    prompt_logprobs: dict[str, list]  # request_id -> per-position {id: (logprob, rank)}
    override_consumed: bool


class StepHandle:
    """A submitted step; ``result()`` waits for its tokens (once) and retires its staging buffer."""

    def __init__(self, runner: "ModelRunner", step: int, staging_index: int, wait: Callable[[], StepOutput]) -> None:
        self.runner, self.step, self.staging_index, self._wait = runner, step, staging_index, wait
        self._result: StepOutput | None = None

    def result(self) -> StepOutput:
        if self._result is None:
            try:
                self._result = self._wait()
            finally:  # a step that failed holds its staging buffer no longer
                self.runner._retire(self)
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
                self.runner._retire(self)


class ModelRunner:
    def __init__(self, model: nn.Module, family: ModelFamily, vocab_size: int, device: torch.device,
                 dtype: torch.dtype, block_size: int, num_kv_blocks: int | None, gpu_memory_utilization: float,
                 max_model_len: int, max_num_seqs: int, eos_token_ids: Sequence[int], seed: int,
                 depth: int = 1, enforce_eager: bool = False) -> None:
        self.model, self.family, self.device, self.dtype = model, family, device, dtype
        self.block_size = block_size
        self.vocab_size = vocab_size
        self.depth = depth
        self.attention_layers = [m for m in model.modules() if isinstance(m, Attention)]
        self.stateful_layers = [m for m in model.modules() if isinstance(m, StatefulLayer)]
        for layer in self.stateful_layers:  # a state slot per running request (its mirror slot), and the dummy
            layer.allocate_state(max_num_seqs + 1, device)
        self.num_kv_blocks = num_kv_blocks or self._auto_blocks(gpu_memory_utilization, max_model_len * max_num_seqs)
        self._allocate_kv_cache()
        self.sampler = Sampler(vocab_size, device, eos_token_ids, seed)
        self.scope = get_plugins().pm.hook.vtcore_device_token_scope(family=family, scope=device_token_scope) \
            or device_token_scope
        # one slot per running request, and a dummy slot (the last) that padded decode rows name
        self.dummy_slot = max_num_seqs
        self.last_sampled_tokens = torch.full((max_num_seqs + 1,), PLACEHOLDER, dtype=torch.int64, device=device)
        self.cuda = device.type == "cuda"
        self._staging: list[torch.Tensor] = [torch.empty(0, dtype=torch.int64) for _ in range(depth)]
        self._staging_owner: list[int | None] = [None] * depth
        self._worker = ThreadPoolExecutor(1, "vtcore-forward") if depth > 1 and not self.cuda else None
        self._steps = 0
        self.consuming_forwards = 0  # forwards in which EmbedInto consumed the device-token override
        self.stale_forwards = 0  # forwards whose host ids held placeholders (each must consume the override)
        self.withhold_override = False  # test hook: the conformance B arm
        self.debug_poison = os.environ.get("VTCORE_DEBUG_STAGING_POISON", "")  # "guard" | "early" (GPU race tests)
        self.debug_sleep_cycles = int(os.environ.get("VTCORE_DEBUG_SAMPLER_SLEEP", "0"))
        self.graph_sizes: list[int] = []
        self.padded_decode_steps = self.graph_replays = 0
        # a module that must read host values to decode (a stateful layer without device-indexed
        # decode, W4A4 experts) keeps the model eager
        if not enforce_eager and all(getattr(m, "supports_decode_graphs", True) for m in model.modules()):
            self._setup_decode_graphs(max_model_len, max_num_seqs, capture=self.cuda)

    # ------------------------------------------------------------------ memory
    def _bytes_per_block(self) -> int:
        per_token = sum(2 * a.num_kv_heads * a.head_dim for a in self.attention_layers)
        return per_token * self.block_size * torch.empty((), dtype=self.dtype).element_size()

    def _auto_blocks(self, utilization: float, max_tokens: int) -> int:
        per_block = max(self._bytes_per_block(), 1)
        wanted = -(-max_tokens // self.block_size)
        if self.device.type == "cuda":
            free, total = torch.cuda.mem_get_info(self.device)
            budget = int(total * utilization) - (total - free)
            if budget < per_block:
                raise RuntimeError(f"gpu_memory_utilization={utilization}: leaves no memory for the KV cache "
                                   f"({free / 2**30:.1f} GiB free of {total / 2**30:.1f} GiB)")
            return min(budget // per_block, wanted)
        return max(1, min(CPU_KV_BYTES // per_block, wanted))

    def _allocate_kv_cache(self) -> None:
        slots = self.num_kv_blocks * self.block_size
        for layer in self.attention_layers:
            shape = (slots, layer.num_kv_heads, layer.head_dim)
            layer.k_cache = torch.zeros(shape, dtype=self.dtype, device=self.device)
            layer.v_cache = torch.zeros(shape, dtype=self.dtype, device=self.device)
            layer.block_size = self.block_size

    # ------------------------------------------------------------------ staging
    def _stage(self, sections: list[list[int]], align: int = 2) -> tuple[int, torch.Tensor, list[tuple[int, int]]]:
        """Pack int sections into this step's pinned staging buffer; returns (index, host slice, bounds).

        Each section starts at a multiple of ``align`` int64s, 16 bytes by default: Triton specialises
        a kernel on its pointers' alignment, so a view at an odd offset would compile another variant
        mid-run (a ~1 s stall). The padded decode path packs densely (``align=1``): its layout is
        the one its graphs captured."""
        index = self._steps % self.depth
        owner = self._staging_owner[index]
        if owner is not None:
            raise RuntimeError(f"staging buffer {index} is still owned by step {owner}: "
                               f"more than depth={self.depth} steps in flight")
        flat: list[int] = []
        bounds = []
        for s in sections:
            bounds.append((len(flat), len(flat) + len(s)))
            flat += s
            flat += [0] * (-len(flat) % align)
        host = self._staging[index]
        if host.numel() < len(flat):
            host = torch.empty(max(len(flat), 2 * host.numel()), dtype=torch.int64, pin_memory=self.cuda)
            self._staging[index] = host
        host[:len(flat)] = torch.tensor(flat, dtype=torch.int64)
        self._staging_owner[index] = self._steps
        return index, host[:len(flat)], bounds

    def _upload(self, host: torch.Tensor, bounds: list[tuple[int, int]], dest: torch.Tensor | None = None
                ) -> list[torch.Tensor]:
        """Device views of the staged sections: one non-blocking copy on CUDA, into ``dest`` (a
        persistent buffer) when given, else into a new tensor (on CPU without ``dest``: the host views)."""
        if dest is not None:
            dev = dest[:host.numel()].copy_(host, non_blocking=True)
        else:
            dev = host.to(self.device, non_blocking=True) if self.cuda else host
        if self.debug_poison == "early":
            host.fill_(PLACEHOLDER)  # control arm: reuse without the guard
        return [dev[a:b] for a, b in bounds]

    def _retire(self, handle: StepHandle) -> None:
        self._staging_owner[handle.staging_index] = None
        if self.debug_poison == "guard":
            self._staging[handle.staging_index].fill_(PLACEHOLDER)  # the first moment the guard allows

    def _to_host(self, t: torch.Tensor) -> torch.Tensor:
        if not self.cuda:
            return t
        host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
        host.copy_(t, non_blocking=True)
        return host

    # ------------------------------------------------------------------ a step
    def submit(self, batch: Batch) -> StepHandle:
        """Prepare ``batch`` on the host and enqueue its device work; returns without waiting for it.
        If that raises, the step holds no staging buffer."""
        step = self._steps
        try:
            return self._submit(batch)
        except BaseException:
            self._staging_owner = [None if owner == step else owner for owner in self._staging_owner]
            raise

    def _submit(self, batch: Batch) -> StepHandle:
        if self.graph_sizes and len(batch) <= self.graph_sizes[-1] and not self.withhold_override \
                and all(s.num_tokens == 1 and s.samples for s in batch):
            return self._submit_decode(batch)
        bs = self.block_size
        ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        combine_rows: list[int] = []
        combine_slots: list[int] = []
        sample_rows: list[int] = []
        metas: list[SampleMeta] = []
        plp: list[tuple[Any, int, int, int]] = []  # (request, first row, first position, count)
        max_q = max(s.num_tokens for s in batch)
        max_ctx = max(s.start + s.num_tokens for s in batch)
        max_blocks = -(-max_ctx // bs)
        block_table: list[int] = []
        context_lens: list[int] = []
        query_start: list[int] = [0]
        seq_rows: list[tuple[int, int]] = []
        for s in batch:
            req, start, n = s.request, s.start, s.num_tokens
            row0 = len(ids)
            known = req.token_ids[start:start + n]
            if len(known) < n:  # the in-flight token: filled on the device by the combine
                combine_rows.append(row0 + len(known))
                combine_slots.append(req.mirror_slot)
                known = known + [PLACEHOLDER]
            ids += known
            pos = range(start, start + n)
            positions += pos
            slots += [req.block_ids[p // bs] * bs + p % bs for p in pos]
            table = req.block_ids[:max_blocks]
            block_table += table + [0] * (max_blocks - len(table))
            context_lens.append(start + n)
            query_start.append(row0 + n)
            seq_rows.append((row0, n))
            if s.samples:
                sample_rows.append(row0 + n - 1)
                metas.append(SampleMeta(req, req.token_ids[:start + n - 1], start + n - req.num_prompt_tokens))
            if req.prompt_logprobs is not None:
                # Rows predicting prompt tokens 1..P-1 not yet asked for; a recompute after
                # preemption (or an in-flight earlier chunk) must not ask twice.
                first = max(start, req.prompt_logprobs_scheduled - 1)
                last = min(start + n, req.num_prompt_tokens - 1)
                if last > first:
                    plp.append((req, row0 + first - start, first, last - first))
                    req.prompt_logprobs_scheduled = last + 1
        sample_slots = [m.request.mirror_slot for m in metas]
        state_slots = [s.request.mirror_slot for s in batch]
        has_state = [s.start > 0 for s in batch]
        index, host, bounds = self._stage([ids, positions, slots, block_table, context_lens, query_start,
                                            combine_rows, combine_slots, sample_rows, sample_slots])
        sampling = self.sampler.prepare(metas)
        stale = bool(combine_rows)
        step = self._steps
        self._steps += 1

        def device_work() -> dict[str, Any]:
            (d_ids, d_pos, d_slots, d_table, d_ctx, d_qstart, d_crows, d_cslots, d_srows,
             d_sslots) = self._upload(host, bounds)
            input_ids = d_ids
            if stale:
                input_ids = d_ids.clone()
                input_ids[d_crows] = self.last_sampled_tokens[d_cslots]
            set_attention_metadata(AttentionMetadata(
                slot_mapping=d_slots, block_tables=d_table.view(len(batch), max_blocks), context_lens=d_ctx,
                query_start_loc=d_qstart, max_query_len=max_q, max_context_len=max_ctx, seq_rows=seq_rows,
                state_slots=state_slots, has_state=has_state))
            try:
                override_ids = input_ids if stale and not self.withhold_override else None
                with torch.inference_mode(), self.scope(override_ids, stale) as override:
                    hidden = self.model(d_ids, d_pos)
                consumed = bool(override is not None and override.consumed)
            finally:
                set_attention_metadata(None)
            out: dict[str, Any] = {"consumed": consumed, "stale": stale, "plp": {}}
            with torch.inference_mode():
                if metas:
                    logits = self.model.compute_logits(hidden[d_srows]).float()
                    self._sample(out, logits, sampling, input_ids[d_srows], d_sslots)
                for req, row0, start, count in plp:
                    logits = self.model.compute_logits(hidden[row0:row0 + count])
                    targets = to_device(req.token_ids[start + 1:start + 1 + count], torch.int64, self.device)
                    out["plp"][req.request_id] = {k: self._to_host(v) for k, v in prompt_logprobs(
                        logits, targets, req.params.prompt_logprobs).items()}
            return out

        return self._enqueue(step, index, device_work)

    def _sample(self, out: dict[str, Any], logits: torch.Tensor, sampling: Any, fed: torch.Tensor,
                mirror_slots: torch.Tensor) -> None:
        """Sample, write the tokens into the device mirror, and start their copies to the host."""
        if self.debug_sleep_cycles and self.cuda:
            torch.cuda._sleep(self.debug_sleep_cycles)
        sampled = self.sampler.sample(logits, sampling, fed)
        self.last_sampled_tokens[mirror_slots] = sampled["tokens"]
        out.update({k: self._to_host(v) for k, v in sampled.items()})

    def _enqueue(self, step: int, index: int, device_work: Callable[[], dict[str, Any]]) -> StepHandle:
        """Run ``device_work`` (on the worker thread on CPU at depth > 1) and hand back its handle."""
        if self._worker is not None:
            future: Future = self._worker.submit(device_work)
            return StepHandle(self, step, index, lambda: self._finish(future.result(), None))
        out = device_work()
        event = None
        if self.cuda:
            event = torch.cuda.Event()
            event.record()
        return StepHandle(self, step, index, lambda: self._finish(out, event))

    # ------------------------------------------------------------------ padded decode (CUDA graphs)
    def _setup_decode_graphs(self, max_model_len: int, max_num_seqs: int, capture: bool) -> None:
        """Persistent inputs for pure-decode steps, padded to a batch size of ``graph_sizes``.

        One flat int64 buffer holds, for padded size P, six sections of P rows (ids, positions,
        KV slots, context lengths, combine slots, mirror slots), then the real rows' block table;
        a step uploads into it with one copy. The block table is then copied into the persistent
        ``[P, max_blocks]`` table the kernels read. The combine (-1: the host id is current) runs
        inside the graph. Padded rows: id 0, position 0, KV slot -1 (never written), context 1, no
        combine, the dummy mirror slot; their samples are never written to ``last_sampled_tokens``.
        """
        self._padding = [0, 0, -1, 1, -1, self.dummy_slot]
        largest = min(max_num_seqs, DECODE_GRAPH_MAX)
        self.graph_sizes = [p for p in DECODE_GRAPH_SIZES if p < largest] + [largest]
        self.max_table = -(-max_model_len // self.block_size)
        self._dec_buf = torch.zeros(6 * largest + largest * self.max_table, dtype=torch.int64, device=self.device)
        self._dec_tables = torch.zeros(largest, self.max_table, dtype=torch.int32, device=self.device)
        self._dec_qstart = torch.arange(largest + 1, dtype=torch.int32, device=self.device)
        # the six sections of padded size p: views fixed once, as the graphs read them
        self._dec_views = {p: [self._dec_buf[i * p:(i + 1) * p] for i in range(6)] for p in self.graph_sizes}
        self._graphs: dict[int, tuple[torch.cuda.CUDAGraph, tuple[torch.Tensor, torch.Tensor], bool]] = {}
        if capture:
            self._capture_graphs(max_model_len)

    def _decode_forward(self, p: int, max_context_len: int) -> tuple[torch.Tensor, torch.Tensor, bool]:
        """The padded decode forward of size ``p``: combine, model, logits. Captured on CUDA."""
        ids, pos, slots, ctx, combine, mirror = self._dec_views[p]
        fed = torch.where(combine >= 0, self.last_sampled_tokens[combine.clamp(min=0)], ids)
        set_attention_metadata(AttentionMetadata(
            slot_mapping=slots, block_tables=self._dec_tables[:p], context_lens=ctx,
            query_start_loc=self._dec_qstart[:p + 1], max_query_len=1, max_context_len=max_context_len,
            state_index=mirror, state_continues=pos > 0))
        try:
            with self.scope(fed, True) as override:
                hidden = self.model(ids, pos)
            consumed = bool(override is not None and override.consumed)
        finally:
            set_attention_metadata(None)
        return fed, self.model.compute_logits(hidden).float(), consumed

    def _capture_graphs(self, max_model_len: int) -> None:
        pool = None
        with torch.inference_mode():
            for p in reversed(self.graph_sizes):  # largest first: the others reuse its memory pool
                padding = torch.tensor(self._padding, device=self.device)[:, None]
                self._dec_buf[:6 * p].view(6, p).copy_(padding)  # all rows padded: the capture writes no KV
                self._decode_forward(p, max_model_len)  # warm-up: compiles kernels, sizes workspaces
                torch.cuda.synchronize(self.device)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool):
                    fed, logits, consumed = self._decode_forward(p, max_model_len)
                pool = graph.pool()
                self._graphs[p] = (graph, (fed, logits), consumed)
        torch.cuda.synchronize(self.device)

    def _submit_decode(self, batch: Batch) -> StepHandle:
        bs, n = self.block_size, len(batch)
        p = next(size for size in self.graph_sizes if size >= n)
        pad = p - n
        cols: list[list[int]] = [[] for _ in range(6)]
        metas: list[SampleMeta] = []
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
            metas.append(SampleMeta(req, req.token_ids[:pos], pos + 1 - req.num_prompt_tokens))
        for col, v in zip(cols, self._padding):
            col += [v] * pad
        index, host, bounds = self._stage(cols + [table], align=1)
        sampling = self.sampler.prepare(metas)
        step = self._steps
        self._steps += 1
        graph = self._graphs.get(p)
        max_ctx = max(s.start for s in batch) + 1
        self.padded_decode_steps += 1

        def device_work() -> dict[str, Any]:
            table_rows = self._upload(host, bounds, self._dec_buf)[6]
            self._dec_tables[:n, :width].copy_(table_rows.view(n, width))
            with torch.inference_mode():
                if graph is not None:
                    graph[0].replay()
                    (fed, logits), consumed = graph[1], graph[2]
                    self.graph_replays += 1
                else:
                    fed, logits, consumed = self._decode_forward(p, max_ctx)
                out: dict[str, Any] = {"consumed": consumed, "stale": stale, "plp": {}}
                self._sample(out, logits[:n], sampling, fed[:n], self._dec_views[p][5][:n])
            return out

        return self._enqueue(step, index, device_work)

    def _finish(self, out: dict[str, Any], event: torch.cuda.Event | None) -> StepOutput:
        if event is not None:
            event.synchronize()
        self.stale_forwards += out["stale"]
        if out["consumed"] and out["stale"]:
            self.consuming_forwards += 1
        plp = {}
        for rid, t in out["plp"].items():
            plp[rid] = _plp_entries(t)
        if "tokens" not in out:
            return StepOutput([], None, None, None, None, plp, out["consumed"])
        lp = "logprobs" in out
        return StepOutput(out["tokens"].tolist(), out["logprobs"].tolist() if lp else None,
                          out["ranks"].tolist() if lp else None, out["top_ids"].tolist() if lp else None,
                          out["top_logprobs"].tolist() if lp else None, plp, out["consumed"])

    def shutdown(self) -> None:
        if self._worker is not None:
            self._worker.shutdown(wait=True)


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
