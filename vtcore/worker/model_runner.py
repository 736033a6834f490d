"""The model runner: owns the model and its KV cache; turns a scheduled batch into samples.

One runner serves the sync and the async engine alike. Per step: build the flat token layout
(input ids, positions, cache slots) and the padded attention layout on the host, upload them,
run the forward inside the device-token override scope, compute logits only for the rows that
sample or need prompt logprobs, and sample.
"""
from __future__ import annotations

import logging
from typing import Sequence

import attrs
import torch
from torch import nn

from vtcore.engine.request import Request
from vtcore.family import ModelFamily
from vtcore.layers.attention import Attention, AttentionMetadata, set_attention_metadata
from vtcore.layers.embedding import device_token_scope
from vtcore.plugins.manager import get_plugins
from vtcore.worker.sampler import SampleResult, Sampler, prompt_logprobs

log = logging.getLogger("vtcore")

CPU_KV_BYTES = 1 << 30  # the KV budget on CPU when num_kv_blocks is not given


@attrs.define
class StepOutput:
    """What one step produced: samples for the requests that sample, prompt logprobs for the rest."""

    sampled: dict[str, int]  # request_id -> token
    samples: SampleResult | None
    sample_rows: dict[str, int]  # request_id -> row in ``samples``
    prompt_logprobs: dict[str, list]  # request_id -> per-position {id: (logprob, rank)}


class ModelRunner:
    def __init__(self, model: nn.Module, family: ModelFamily, vocab_size: int, device: torch.device,
                 dtype: torch.dtype, block_size: int, num_kv_blocks: int | None, gpu_memory_utilization: float,
                 max_model_len: int, max_num_seqs: int, eos_token_ids: Sequence[int], seed: int) -> None:
        self.model, self.family, self.device, self.dtype = model, family, device, dtype
        self.block_size = block_size
        self.vocab_size = vocab_size
        self.attention_layers = [m for m in model.modules() if isinstance(m, Attention)]
        self.num_kv_blocks = num_kv_blocks or self._auto_blocks(gpu_memory_utilization, max_model_len * max_num_seqs)
        self._allocate_kv_cache()
        self.sampler = Sampler(vocab_size, device, eos_token_ids, seed)
        self.scope = get_plugins().pm.hook.vtcore_device_token_scope(family=family, scope=device_token_scope) \
            or device_token_scope

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

    def _upload(self, data: list, dtype: torch.dtype = torch.int64) -> torch.Tensor:
        return torch.tensor(data, dtype=dtype, pin_memory=self.device.type == "cuda").to(self.device, non_blocking=True)

    @torch.inference_mode()
    def execute(self, batch: Sequence[tuple[Request, int]]) -> StepOutput:
        """Run one step over ``batch`` (request, number of new tokens) and sample where due."""
        bs = self.block_size
        ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        sample_rows: list[int] = []
        sample_reqs: list[Request] = []
        plp_rows: list[tuple[Request, int, int, int]] = []  # (request, first row, first position, count)
        max_q = max(n for _, n in batch)
        max_ctx = max(r.num_computed_tokens + n for r, n in batch)
        max_blocks = -(-max_ctx // bs)
        block_table, query_index, query_pos, query_valid = [], [], [], []
        for req, n in batch:
            start = req.num_computed_tokens
            row0 = len(ids)
            ids += req.token_ids[start:start + n]
            pos = list(range(start, start + n))
            positions += pos
            slots += [req.block_ids[p // bs] * bs + p % bs for p in pos]
            block_table.append(req.block_ids[:max_blocks] + [0] * (max_blocks - len(req.block_ids[:max_blocks])))
            query_index.append(list(range(row0, row0 + n)) + [0] * (max_q - n))
            query_pos.append(pos + [0] * (max_q - n))
            query_valid.append([True] * n + [False] * (max_q - n))
            if start + n == req.num_tokens:
                sample_rows.append(row0 + n - 1)
                sample_reqs.append(req)
            if req.params.prompt_logprobs is not None and start < req.num_prompt_tokens - 1 \
                    and req.prompt_logprobs is not None and len(req.prompt_logprobs) < req.num_prompt_tokens:
                last = min(start + n, req.num_prompt_tokens - 1)  # rows predicting prompt tokens 1..P-1
                plp_rows.append((req, row0, start, last - start))
        tables = self._upload(block_table)
        key_slots = (tables[:, :, None] * bs + torch.arange(bs, device=self.device)).view(len(batch), -1)[:, :max_ctx]
        set_attention_metadata(AttentionMetadata(
            slot_mapping=self._upload(slots), key_slots=key_slots, query_index=self._upload(query_index),
            query_positions=self._upload(query_pos), query_valid=self._upload(query_valid, torch.bool)))
        input_ids = self._upload(ids)
        try:
            with self.scope(None, False):
                hidden = self.model(input_ids, self._upload(positions))
        finally:
            set_attention_metadata(None)
        out = StepOutput({}, None, {}, {})
        if sample_reqs:
            logits = self.model.compute_logits(hidden[sample_rows]).float()
            out.samples = self.sampler(logits, sample_reqs)
            for row, req in enumerate(sample_reqs):
                out.sampled[req.request_id] = out.samples.token_ids[row]
                out.sample_rows[req.request_id] = row
        for req, row0, start, count in plp_rows:
            logits = self.model.compute_logits(hidden[row0:row0 + count])
            out.prompt_logprobs[req.request_id] = prompt_logprobs(
                logits, req.token_ids[start + 1:start + 1 + count], req.params.prompt_logprobs)
        return out
