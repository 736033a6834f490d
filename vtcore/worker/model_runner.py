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
            self._result = self._wait()
            self.runner._retire(self)
        return self._result


class ModelRunner:
    def __init__(self, model: nn.Module, family: ModelFamily, vocab_size: int, device: torch.device,
                 dtype: torch.dtype, block_size: int, num_kv_blocks: int | None, gpu_memory_utilization: float,
                 max_model_len: int, max_num_seqs: int, eos_token_ids: Sequence[int], seed: int,
                 depth: int = 1) -> None:
        self.model, self.family, self.device, self.dtype = model, family, device, dtype
        self.block_size = block_size
        self.vocab_size = vocab_size
        self.depth = depth
        self.attention_layers = [m for m in model.modules() if isinstance(m, Attention)]
        self.stateful_layers = [m for m in model.modules() if isinstance(m, StatefulLayer)]
        for layer in self.stateful_layers:  # one state slot per running request (its mirror slot)
            layer.allocate_state(max_num_seqs, device)
        self.num_kv_blocks = num_kv_blocks or self._auto_blocks(gpu_memory_utilization, max_model_len * max_num_seqs)
        self._allocate_kv_cache()
        self.sampler = Sampler(vocab_size, device, eos_token_ids, seed)
        self.scope = get_plugins().pm.hook.vtcore_device_token_scope(family=family, scope=device_token_scope) \
            or device_token_scope
        self.last_sampled_tokens = torch.full((max_num_seqs,), PLACEHOLDER, dtype=torch.int64, device=device)
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

    # ------------------------------------------------------------------ staging
    def _stage(self, sections: list[list[int]]) -> tuple[int, list[torch.Tensor]]:
        """Pack int sections into this step's staging buffer and upload it; returns device views."""
        index = self._steps % self.depth
        owner = self._staging_owner[index]
        if owner is not None:
            raise RuntimeError(f"staging buffer {index} is still owned by step {owner}: "
                               f"more than depth={self.depth} steps in flight")
        flat = [v for s in sections for v in s]
        host = self._staging[index]
        if host.numel() < len(flat):
            host = torch.empty(max(len(flat), 2 * host.numel()), dtype=torch.int64, pin_memory=self.cuda)
            self._staging[index] = host
        host[:len(flat)] = torch.tensor(flat, dtype=torch.int64)
        self._staging_owner[index] = self._steps
        dev = host[:len(flat)].to(self.device, non_blocking=True) if self.cuda else host[:len(flat)]
        if self.debug_poison == "early":
            host.fill_(PLACEHOLDER)  # control arm: reuse without the guard
        views, offset = [], 0
        for s in sections:
            views.append(dev[offset:offset + len(s)])
            offset += len(s)
        return index, views

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
        """Prepare ``batch`` on the host and enqueue its device work; returns without waiting for it."""
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
        max_blocks = -(-max(s.start + s.num_tokens for s in batch) // bs)
        max_ctx = max(s.start + s.num_tokens for s in batch)
        block_table: list[int] = []
        query_index: list[int] = []
        query_pos: list[int] = []
        query_valid: list[int] = []
        token_index: list[int] = []
        seq_rows: list[tuple[int, int]] = []
        for b, s in enumerate(batch):
            req, start, n = s.request, s.start, s.num_tokens
            row0 = len(ids)
            known = req.token_ids[start:start + n]
            if len(known) < n:  # the in-flight token: filled on the device by the combine
                combine_rows.append(row0 + len(known))
                combine_slots.append(req.mirror_slot)
                known = known + [PLACEHOLDER]
            ids += known
            pos = list(range(start, start + n))
            positions += pos
            slots += [req.block_ids[p // bs] * bs + p % bs for p in pos]
            table = req.block_ids[:max_blocks]
            block_table += table + [0] * (max_blocks - len(table))
            query_index += list(range(row0, row0 + n)) + [0] * (max_q - n)
            query_pos += pos + [0] * (max_q - n)
            query_valid += [1] * n + [0] * (max_q - n)
            token_index += range(b * max_q, b * max_q + n)
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
        index, (d_ids, d_pos, d_slots, d_table, d_qidx, d_qpos, d_qvalid, d_tidx, d_crows, d_cslots, d_srows,
                d_sslots) = self._stage([ids, positions, slots, block_table, query_index, query_pos, query_valid,
                                        token_index, combine_rows, combine_slots, sample_rows, sample_slots])
        sampling = self.sampler.prepare(metas)
        stale = bool(combine_rows)
        step = self._steps
        self._steps += 1

        def device_work() -> dict[str, Any]:
            input_ids = d_ids
            if stale:
                input_ids = d_ids.clone()
                input_ids[d_crows] = self.last_sampled_tokens[d_cslots]
            tables = d_table.view(len(batch), max_blocks)
            key_slots = (tables[:, :, None] * bs + torch.arange(bs, device=self.device)).view(len(batch), -1)
            set_attention_metadata(AttentionMetadata(
                slot_mapping=d_slots, key_slots=key_slots[:, :max_ctx], query_index=d_qidx.view(len(batch), max_q),
                query_positions=d_qpos.view(len(batch), max_q), query_valid=d_qvalid.view(len(batch), max_q).bool(),
                token_index=d_tidx, seq_rows=seq_rows, state_slots=state_slots, has_state=has_state))
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
                    if self.debug_sleep_cycles and self.cuda:
                        torch.cuda._sleep(self.debug_sleep_cycles)
                    sampled = self.sampler.sample(logits, sampling, input_ids[d_srows])
                    self.last_sampled_tokens[d_sslots] = sampled["tokens"]
                    out.update({k: self._to_host(v) for k, v in sampled.items()})
                for req, row0, start, count in plp:
                    logits = self.model.compute_logits(hidden[row0:row0 + count])
                    targets = to_device(req.token_ids[start + 1:start + 1 + count], torch.int64, self.device)
                    out["plp"][req.request_id] = {k: self._to_host(v) for k, v in prompt_logprobs(
                        logits, targets, req.params.prompt_logprobs).items()}
            return out

        if self._worker is not None:
            future: Future = self._worker.submit(device_work)
            return StepHandle(self, step, index, lambda: self._finish(future.result(), None))
        out = device_work()
        event = None
        if self.cuda:
            event = torch.cuda.Event()
            event.record()
        return StepHandle(self, step, index, lambda: self._finish(out, event))

    def _finish(self, out: dict[str, Any], event: torch.cuda.Event | None) -> StepOutput:
        if event is not None:
            event.synchronize()
        self.stale_forwards += out["stale"]
        if out["consumed"]:
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
