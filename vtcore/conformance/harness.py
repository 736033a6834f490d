"""Driving one engine step by step, to compare sync and async runs batch for batch."""
from __future__ import annotations

import random
from typing import Any, Callable

from vtcore.engine.llm_engine import LLMEngine
from vtcore.outputs import CompletionOutput
from vtcore.engine.scheduler import Batch
from vtcore.sampling_params import SamplingParams

#: Requests arriving before the n-th ``step()`` call: {n: [(request_id, prompt ids, params)]}, each tuple
#: optionally ending in the request's priority (``scheduling_policy="priority"``).
Arrivals = dict[int, list[tuple[Any, ...]]]
MODES = ("sync", "async", "mirror-off")


def build_engine(path: str, mode: str, **knobs: Any) -> LLMEngine:
    """An engine over ``path``: 'sync', 'async' (device mirror on) or 'mirror-off' (host waits)."""
    from vtcore.engine.llm import LLM

    if mode not in MODES:
        raise ValueError(f"mode={mode!r}: expected one of {MODES}")
    return LLM(path, async_scheduling=mode != "sync", async_device_mirror=mode == "async", **knobs).engine


def run_engine(engine: LLMEngine, arrivals: Arrivals, observe: Callable[[Batch], None] | None = None,
               finals: dict[str, CompletionOutput] | None = None
               ) -> tuple[dict[str, list[int]], list[list[tuple[str, int, int]]]]:
    """Run to completion; returns the final tokens per request and every scheduled batch
    as (request_id, first token, token count) rows. ``observe`` sees each non-empty batch as it is
    scheduled (its requests' block tables and slots are current then); ``finals`` collects each
    request's final output."""
    batches: list[list[tuple[str, int, int]]] = []
    schedule = engine.scheduler.schedule

    def recording_schedule() -> Any:
        batch = schedule()
        if batch:
            batches.append([(s.request.request_id, s.start, s.num_tokens) for s in batch])
            if observe is not None:
                observe(batch)
        return batch

    engine.scheduler.schedule = recording_schedule
    tokens: dict[str, list[int]] = {}
    call = 0
    try:
        while call <= max(arrivals, default=0) or engine.has_unfinished_requests():
            for rid, ids, params, *priority in arrivals.get(call, []):
                engine.add_request(rid, {"prompt_token_ids": ids}, params, *priority)
            for out in engine.step():
                if out.finished:
                    tokens[out.request_id] = out.outputs[0].token_ids
                    if finals is not None:
                        finals[out.request_id] = out.outputs[0]
            call += 1
    finally:
        engine.scheduler.schedule = schedule
    return tokens, batches


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)


def mixed_arrivals(n: int, seed: int, vocab_size: int, max_prompt: int = 30) -> Arrivals:
    """``n`` requests of mixed prompt lengths and max_tokens, half arriving after the first steps,
    greedy and seeded-sampled alternately, some asking for logprobs."""
    rng = random.Random(seed)
    arrivals: Arrivals = {}
    for i in range(n):
        at = 0 if i < n // 2 else rng.randrange(1, 12)
        ids = [rng.randrange(vocab_size) for _ in range(rng.randrange(1, max_prompt))]
        params = SamplingParams(temperature=0 if i % 2 else 0.9, seed=i, max_tokens=rng.randrange(1, 24),
                                ignore_eos=True, logprobs=1 if i % 3 == 0 else None)
        arrivals.setdefault(at, []).append((f"r{i}", ids, params))
    return arrivals
