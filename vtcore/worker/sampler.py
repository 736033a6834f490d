"""Turns a step's logits into tokens, per request: penalties, bias, temperature, top-k/p, min-p, seeds.

Order, per row: logit_bias, min_tokens (stop ids masked), repetition / presence / frequency
penalties, then greedy argmax or: temperature, top-k, top-p (over the top-k renormalised),
min-p (relative to the top probability), and a draw. A draw is ``argmax(p / q)`` with
``q ~ Exp(1)`` per vocabulary entry (the exponential race, equal in law to sampling from p);
a seeded request draws ``q`` from its own generator, so its draws do not depend on the batch.
Logprobs are the raw model's log-softmax, before any of the above (vLLM's default).
"""
from __future__ import annotations

from typing import Sequence

import attrs
import torch

from vtcore.engine.request import Request


@attrs.define
class SampleResult:
    """Host copies of a step's samples."""

    token_ids: list[int]
    logprobs: list[float] | None  # the sampled token's raw logprob, per row
    ranks: list[int] | None
    top_ids: list[list[int]] | None  # the top-k ids per row (k = the largest asked for in the batch)
    top_logprobs: list[list[float]] | None


def _stop_ids(req: Request, eos_ids: Sequence[int]) -> list[int]:
    ids = list(req.params.stop_token_ids)
    return ids if req.params.ignore_eos else ids + list(eos_ids)


class Sampler:
    def __init__(self, vocab_size: int, device: torch.device, eos_token_ids: Sequence[int], seed: int) -> None:
        self.vocab_size = vocab_size
        self.device = device
        self.eos_token_ids = list(eos_token_ids)
        self.generator = torch.Generator(device=device).manual_seed(seed)

    def _process(self, logits: torch.Tensor, reqs: Sequence[Request]) -> torch.Tensor:
        """Apply logit_bias, min_tokens and the penalties; returns a new tensor only when needed."""
        logits = logits.clone()
        for row, req in enumerate(reqs):
            p = req.params
            if p.logit_bias:
                ids = torch.tensor(list(p.logit_bias), device=self.device)
                logits[row, ids] += torch.tensor(list(p.logit_bias.values()), device=self.device)
            if req.num_output_tokens < p.min_tokens:
                stops = _stop_ids(req, self.eos_token_ids)
                if stops:
                    logits[row, stops] = float("-inf")
            if p.repetition_penalty != 1.0:
                seen = torch.tensor(sorted(set(req.token_ids)), device=self.device)
                vals = logits[row, seen]
                logits[row, seen] = torch.where(vals > 0, vals / p.repetition_penalty, vals * p.repetition_penalty)
            if p.presence_penalty or p.frequency_penalty:
                out = req.output_token_ids
                if out:
                    counts = torch.bincount(torch.tensor(out, device=self.device), minlength=self.vocab_size)
                    logits[row] -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0)
        return logits

    def __call__(self, logits: torch.Tensor, reqs: Sequence[Request]) -> SampleResult:
        """``logits`` [rows, vocab] float32, one row per request in ``reqs``."""
        want_logprobs = [r.params.logprobs for r in reqs if r.params.logprobs is not None]
        raw_logprobs = torch.log_softmax(logits, dim=-1) if want_logprobs else None
        if any(_needs_processing(r) for r in reqs):
            logits = self._process(logits, reqs)
        tokens = logits.argmax(dim=-1)
        random_rows = [i for i, r in enumerate(reqs) if not r.params.greedy]
        if random_rows:
            tokens[random_rows] = self._draw(logits[random_rows], [reqs[i] for i in random_rows])
        host_tokens = tokens.tolist()
        if raw_logprobs is None:
            return SampleResult(host_tokens, None, None, None, None)
        sampled = raw_logprobs.gather(1, tokens[:, None])
        ranks = (raw_logprobs > sampled).sum(dim=-1) + 1
        k = max(want_logprobs)
        top = raw_logprobs.topk(k, dim=-1) if k else None
        return SampleResult(host_tokens, sampled[:, 0].tolist(), ranks.tolist(),
                            top.indices.tolist() if top else [[] for _ in reqs],
                            top.values.tolist() if top else [[] for _ in reqs])

    def _draw(self, logits: torch.Tensor, reqs: Sequence[Request]) -> torch.Tensor:
        temps = torch.tensor([r.params.temperature for r in reqs], device=self.device)
        logits = logits / temps[:, None]
        top_k = [r.params.top_k for r in reqs]
        if any(top_k):
            k = torch.tensor([t if t else self.vocab_size for t in top_k], device=self.device).clamp(max=self.vocab_size)
            kth = logits.sort(dim=-1, descending=True).values.gather(1, (k - 1)[:, None])
            logits = logits.masked_fill(logits < kth, float("-inf"))
        top_p = torch.tensor([r.params.top_p for r in reqs], device=self.device)
        if (top_p < 1.0).any():
            sorted_logits, order = logits.sort(dim=-1, descending=True)
            cum = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
            drop_sorted = (cum - sorted_logits.softmax(dim=-1)) >= top_p[:, None]  # mass before this token
            drop = torch.zeros_like(drop_sorted).scatter(1, order, drop_sorted)
            logits = logits.masked_fill(drop, float("-inf"))
        probs = logits.softmax(dim=-1)
        min_p = torch.tensor([r.params.min_p for r in reqs], device=self.device)
        if (min_p > 0).any():
            probs = probs.masked_fill(probs < min_p[:, None] * probs.max(dim=-1, keepdim=True).values, 0.0)
        q = torch.empty_like(probs)
        unseeded = [i for i, r in enumerate(reqs) if r.generator is None]
        if unseeded:
            q[unseeded] = torch.empty(len(unseeded), probs.shape[1], device=self.device).exponential_(
                generator=self.generator)
        for i, r in enumerate(reqs):
            if r.generator is not None:
                q[i].exponential_(generator=r.generator)
        return (probs / q).argmax(dim=-1)


def _needs_processing(req: Request) -> bool:
    p = req.params
    return bool(p.logit_bias or p.repetition_penalty != 1.0 or p.presence_penalty or p.frequency_penalty
                or req.num_output_tokens < p.min_tokens)


def prompt_logprobs(logits: torch.Tensor, targets: list[int], k: int) -> list[dict[int, tuple[float, int]]]:
    """Raw logprobs of each prompt token given its prefix, and the top k: per position {id: (logprob, rank)}."""
    lp = torch.log_softmax(logits.float(), dim=-1)
    tgt = torch.tensor(targets, device=lp.device)
    chosen = lp.gather(1, tgt[:, None])
    ranks = ((lp > chosen).sum(dim=-1) + 1).tolist()
    chosen = chosen[:, 0].tolist()
    out = []
    top = lp.topk(k, dim=-1) if k else None
    for row, tok in enumerate(targets):
        entry = {tok: (chosen[row], ranks[row])}
        if top is not None:
            for rank, (i, v) in enumerate(zip(top.indices[row].tolist(), top.values[row].tolist()), start=1):
                entry.setdefault(i, (v, rank))
        out.append(entry)
    return out
