"""Turns a step's logits into tokens, per request: penalties, bias, temperature, top-k/p, min-p, seeds.

Order, per row: the grammar's allowed tokens (structured outputs), logit_bias, allowed_token_ids (every
other id masked), bad_words (``vtcore.worker.bad_words``), min_tokens (stop ids masked), repetition /
presence / frequency penalties, then greedy
argmax or: temperature, top-k, top-p (over the top-k renormalised),
min-p (relative to the top probability), and a draw. A draw is ``argmax(p / q)`` with
``q ~ Exp(1)`` per vocabulary entry (the exponential race, equal in law to sampling from p);
a seeded request draws ``q`` from its own generator, so its draws do not depend on the batch.
Logprobs are the raw model's log-softmax, before any of the above (vLLM's default).

Split in two so the async engine never waits on the device: ``prepare`` decides everything on
the host and uploads the per-row parameters without blocking; ``sample`` is device work only.
The token each sampling row was fed (the in-flight token, in async) comes from the device, so
penalties and bad words see it even before the host does.

A constrained row whose grammar does not yet stand at its position (its request's previous token
is in flight) is *late*: ``prepare`` leaves it greedy and unedited, and the runner draws it again
over the same logits with its mask once that token has landed (``prepare(final=True)`` over the
late rows); the first draw is never used, and it takes nothing from a seeded request's generator.
"""
from __future__ import annotations

from typing import Any, Sequence

import attrs
import torch

from vtcore.kernels.bitmask import unpack_bitmask
from vtcore.structured.grammar import fill_bitmasks
from vtcore.worker.bad_words import read_outputs, row_bans
from vtcore.worker.staging import host_tensor
from vtcore.worker.step import StepRequest


def to_device(data: list | torch.Tensor, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Upload a host list (or CPU tensor) without blocking the host (pinned memory on CUDA)."""
    host = data.to(dtype) if torch.is_tensor(data) else host_tensor(data, dtype)
    return host if device.type != "cuda" else host.pin_memory().to(device, non_blocking=True)


@attrs.define
class SampleMeta:
    """A sampling row: its request, the tokens before the fed one (host), outputs in the fed sequence.

    The tokens before the fed one are the request's first ``prior_end`` tokens, then ``draft_head`` (a
    verify row's draft tokens before it); copied out only for penalties (``prior_tokens``)."""

    request: StepRequest
    prior_end: int
    num_outputs: int
    draft_head: tuple[int, ...] = ()

    @property
    def prior_tokens(self) -> list[int]:
        return self.request.token_ids[:self.prior_end] + list(self.draft_head)

    def tail(self, k: int) -> list[int]:
        """The last ``k`` (or fewer, at the start) of ``prior_tokens``, without copying the rest."""
        head = list(self.draft_head[max(0, len(self.draft_head) - k):]) if k > 0 else []
        more = k - len(head)
        return (self.request.token_ids[max(0, self.prior_end - more):self.prior_end] if more > 0 else []) + head

    @property
    def reads_fed(self) -> bool:
        """Whether this row's edits read the token it was fed: penalties, or a bad word of several ids."""
        return self.request.params.penalised or read_outputs(self.request.bad_words)

    @property
    def awaits_mask(self) -> bool:
        """A constrained row of a running request whose grammar does not yet stand at its position (its
        previous token is in flight): drawn late."""
        grammar = self.request.grammar
        return grammar is not None and not self.request.is_finished and not grammar.stands_at(self.num_outputs)


@attrs.define
class SamplingBatch:
    metas: list[SampleMeta]
    greedy: bool  # every row greedy
    temperature: torch.Tensor | None
    top_k: torch.Tensor | None
    top_p: torch.Tensor | None
    min_p: torch.Tensor | None
    random_rows: torch.Tensor | None
    random_list: list[int]  # random_rows on the host
    edits: list[tuple[int, dict[str, Any]]]  # per-row logit edits: (row, tensors)
    max_logprobs: int | None
    masked_rows: torch.Tensor | None = None  # rows held to a grammar's bitmask; None with bitmasks: every row
    bitmasks: torch.Tensor | None = None  # int32 [masked rows, GrammarCache.words]
    late: list[int] = attrs.Factory(list)  # rows drawn again once their mask exists (module doc)


#: pinned bitmask buffers a CUDA sampler turns through (see ``Sampler.__init__``)
MASK_BUFFERS = 6


class Sampler:
    def __init__(self, vocab_size: int, device: torch.device, eos_token_ids: Sequence[int], seed: int) -> None:
        self.vocab_size = vocab_size
        self.device = device
        self.eos_token_ids = list(eos_token_ids)
        self.generator = torch.Generator(device=device).manual_seed(seed)
        # CUDA: pinned bitmask buffers reused in turn; a step fills at most two (its rows, its late rows), and
        # at async depth 2 the step three fills back has finished, its upload with it. CPU: one per fill
        # (the draw may run later, on the worker thread, straight from the host tensor).
        self._mask_ring: list[torch.Tensor] = []
        self._mask_turn = 0

    def _mask_buffer(self, rows: int, words: int) -> torch.Tensor:
        if self.device.type != "cuda":
            return torch.empty((rows, words), dtype=torch.int32)
        if not self._mask_ring:
            self._mask_ring = [torch.empty((0, words), dtype=torch.int32).pin_memory() for _ in range(MASK_BUFFERS)]
        turn, self._mask_turn = self._mask_turn % MASK_BUFFERS, self._mask_turn + 1
        if self._mask_ring[turn].shape[0] < rows or self._mask_ring[turn].shape[1] != words:
            self._mask_ring[turn] = torch.empty((rows, words), dtype=torch.int32).pin_memory()
        return self._mask_ring[turn]

    def _up(self, data: list, dtype: torch.dtype = torch.int64) -> torch.Tensor:
        return to_device(data, dtype, self.device)

    def prepare(self, metas: list[SampleMeta], final: bool = False) -> SamplingBatch:
        """Host side of a step's sampling: flags and per-row tensors, uploaded without waiting.
        ``final``: no row is late; a grammar that still does not stand at its row's position belongs
        to a request that ended meanwhile (the engine drops its token), and masks nothing."""
        late = [] if final else [row for row, m in enumerate(metas) if m.awaits_mask]
        masked = [(row, m.request.grammar) for row, m in enumerate(metas)
                  if m.request.grammar is not None and m.request.grammar.stands_at(m.num_outputs)]
        params = [m.request.params for m in metas]
        drawn_late = set(late)
        random = [i for i, p in enumerate(params) if not p.greedy and i not in drawn_late]
        rnd = [params[i] for i in random]
        edits = []
        for row, m in enumerate(metas):
            if row in drawn_late:
                continue
            p, edit = m.request.params, {}
            if p.logit_bias:
                edit["bias_ids"] = self._up(list(p.logit_bias))
                edit["bias"] = self._up(list(p.logit_bias.values()), torch.float32)
            if p.allowed_token_ids is not None:
                edit["allowed"] = self._up(p.allowed_token_ids)
            words = m.request.bad_words
            if words:
                always, need, last = row_bans(words, m.tail(max(map(len, words)) - 2), m.num_outputs)
                if always:
                    edit["banned"] = self._up(always)
                if need:
                    edit["bad_need"], edit["bad_last"] = self._up(need), self._up(last)
            if m.num_outputs < p.min_tokens:
                stops = list(p.stop_token_ids) + ([] if p.ignore_eos else self.eos_token_ids)
                if stops:
                    edit["stops"] = self._up(stops)
            if p.penalised:
                edit["prior"] = self._up(m.prior_tokens)
                edit["num_prompt"] = m.request.num_prompt_tokens
            if edit:
                edits.append((row, edit))
        wanted = [p.logprobs for p in params if p.logprobs is not None]
        return SamplingBatch(
            metas=metas, greedy=not random,
            temperature=self._up([p.temperature for p in rnd], torch.float32) if rnd else None,
            top_k=self._up([min(p.top_k or self.vocab_size, self.vocab_size) for p in rnd]) if any(p.top_k for p in rnd)
            else None,
            top_p=self._up([p.top_p for p in rnd], torch.float32) if any(p.top_p < 1 for p in rnd) else None,
            min_p=self._up([p.min_p for p in rnd], torch.float32) if any(p.min_p > 0 for p in rnd) else None,
            random_rows=self._up(random) if random else None, random_list=random, edits=edits,
            max_logprobs=max(wanted) if wanted else None,
            masked_rows=self._up([row for row, _ in masked]) if 0 < len(masked) < len(metas) else None,
            # (the mask buffers are pinned already on CUDA: ``_mask_buffer``)
            bitmasks=fill_bitmasks([(g, metas[row].num_outputs) for row, g in masked],
                                   self._mask_buffer(len(masked), masked[0][1].cache.words)
                                   ).to(self.device, non_blocking=True)
            if masked else None,
            late=late)

    def _edit(self, logits: torch.Tensor, batch: SamplingBatch, fed: torch.Tensor) -> torch.Tensor:
        logits = logits.clone()
        if batch.bitmasks is not None and batch.masked_rows is None:
            logits.masked_fill_(~unpack_bitmask(batch.bitmasks, logits.shape[1]), float("-inf"))
        elif batch.bitmasks is not None:
            rows = batch.masked_rows
            logits[rows] = logits[rows].masked_fill(~unpack_bitmask(batch.bitmasks, logits.shape[1]), float("-inf"))
        for row, e in batch.edits:
            p = batch.metas[row].request.params
            if "bias" in e:
                logits[row].index_add_(0, e["bias_ids"], e["bias"])
            if "allowed" in e:
                barred = torch.ones(self.vocab_size, dtype=torch.bool, device=self.device)
                barred[e["allowed"]] = False
                logits[row] = logits[row].masked_fill(barred, float("-inf"))
            if "banned" in e:
                logits[row, e["banned"]] = float("-inf")
            if "bad_need" in e:  # a bad word's last id, where the fed token completes the rest of it
                hits = torch.zeros(self.vocab_size, device=self.device).index_add_(
                    0, e["bad_last"], (e["bad_need"] == fed[row]).float())
                logits[row] = logits[row].masked_fill(hits > 0, float("-inf"))
            if "stops" in e:
                logits[row, e["stops"]] = float("-inf")
            if "prior" in e:
                seq = torch.cat((e["prior"], fed[row:row + 1]))
                if p.repetition_penalty != 1.0:
                    seen = torch.zeros(self.vocab_size, dtype=torch.bool, device=self.device)
                    seen[seq] = True
                    penalised = torch.where(logits[row] > 0, logits[row] / p.repetition_penalty,
                                            logits[row] * p.repetition_penalty)
                    logits[row] = torch.where(seen, penalised, logits[row])
                if p.presence_penalty or p.frequency_penalty:
                    out = seq[e["num_prompt"]:]  # scatter, not bincount: bincount syncs with the host on CUDA
                    counts = torch.zeros(self.vocab_size, device=self.device).index_add_(
                        0, out, torch.ones(out.shape, device=self.device))
                    logits[row] -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).float()
        return logits

    def sample(self, logits: torch.Tensor, batch: SamplingBatch, fed: torch.Tensor | None,
               into: Sequence[tuple[torch.Tensor, torch.Tensor]] = ()) -> dict[str, torch.Tensor]:
        """Device side: ``logits`` [rows, vocab] float32; ``fed`` [rows] the token each row was fed (None when
        no row reads it: ``SampleMeta.reads_fed``). ``into``:
        (target, index) pairs where the tokens are also written, ``target[index] = tokens``."""
        if (logits.is_cuda and batch.greedy and not batch.edits and batch.max_logprobs is None
                and batch.bitmasks is not None and batch.bitmasks.shape[0] == logits.shape[0] and len(into) <= 2):
            # every row greedy and held to a grammar, nothing else edited (a late draw's rows): one launch
            from vtcore.kernels.masked_argmax import masked_argmax

            return {"tokens": masked_argmax(logits, batch.bitmasks, into)}
        out = self._sample(logits, batch, fed)
        for target, index in into:
            target[index] = out["tokens"]
        return out

    def _sample(self, logits: torch.Tensor, batch: SamplingBatch, fed: torch.Tensor) -> dict[str, torch.Tensor]:
        raw = torch.log_softmax(logits, dim=-1) if batch.max_logprobs is not None else None
        if batch.edits or batch.bitmasks is not None:
            logits = self._edit(logits, batch, fed)
        tokens = logits.argmax(dim=-1)
        if not batch.greedy:
            tokens[batch.random_rows] = self._draw(logits[batch.random_rows], batch)
        out = {"tokens": tokens}
        if raw is not None:
            sampled = raw.gather(1, tokens[:, None])
            top = raw.topk(batch.max_logprobs, dim=-1)
            out.update(logprobs=sampled[:, 0], ranks=(raw > sampled).sum(dim=-1) + 1,
                       top_ids=top.indices, top_logprobs=top.values)
        return out

    def _draw(self, logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
        logits = logits / batch.temperature[:, None]
        if batch.top_k is not None:
            kth = logits.sort(dim=-1, descending=True).values.gather(1, (batch.top_k - 1)[:, None])
            logits = logits.masked_fill(logits < kth, float("-inf"))
        if batch.top_p is not None:
            sorted_logits, order = logits.sort(dim=-1, descending=True)
            probs_sorted = sorted_logits.softmax(dim=-1)
            before = probs_sorted.cumsum(dim=-1) - probs_sorted  # mass strictly before each token
            keep_first = torch.arange(before.shape[1], device=before.device) > 0  # a top_p below float32's least keeps it
            drop = torch.zeros_like(before, dtype=torch.bool).scatter(1, order, (before >= batch.top_p[:, None]) & keep_first)
            logits = logits.masked_fill(drop, float("-inf"))
        probs = logits.softmax(dim=-1)
        if batch.min_p is not None:
            probs = probs.masked_fill(probs < batch.min_p[:, None] * probs.max(dim=-1, keepdim=True).values, 0.0)
        reqs = [batch.metas[i].request for i in batch.random_list]
        q = torch.empty_like(probs)
        unseeded = [i for i, r in enumerate(reqs) if r.generator is None]
        if len(unseeded) == len(reqs):
            q.exponential_(generator=self.generator)
        else:
            for i, r in enumerate(reqs):
                q[i].exponential_(generator=r.generator or self.generator)
        return (probs / q).argmax(dim=-1)


def prompt_logprobs(logits: torch.Tensor, targets: torch.Tensor, k: int) -> dict[str, torch.Tensor]:
    """Raw logprobs of each prompt token given its prefix (with rank) and the top k, as device tensors."""
    lp = torch.log_softmax(logits.float(), dim=-1)
    chosen = lp.gather(1, targets[:, None])
    top = lp.topk(k, dim=-1)
    return {"targets": targets, "chosen": chosen[:, 0], "ranks": (lp > chosen).sum(dim=-1) + 1,
            "top_ids": top.indices, "top_logprobs": top.values}
