"""The engine's warm-up on a GPU: before the first request, a few steps down the paths a served load
takes, so Triton compiles (or loads from its disk cache) their kernel variants then, and not inside a
request's step, where each one stalls the whole batch for up to a second on a cold cache.

The paths: a prompt alone (the padded one-chunk step), a short prompt beside a decoding request (an eager
mixed step whose prefill attention splits its keys: few query blocks over a long context), two prompts
at once (eager, unsplit), and decode steps. Greedy requests, so no generator is drawn from; afterwards
no request, cached block, state snapshot, load counter or runner path counter of theirs remains. Then
the constrained rows' draw, which those requests do not take, is compiled by a call of its own.
"""
from __future__ import annotations

from typing import Any

from vtcore.engine.capacity import Buckets
from vtcore.sampling_params import SamplingParams
from vtcore.spec.stats import SpecDecodeStats

PREFIX = "vtcore-warm-up-"
LONG, SHORT = 1024, 17  # prompt lengths: a long context, a one-block-plus chunk beside it


def warm_up(engine: Any) -> None:
    """Run the warm-up requests on ``engine`` (an ``LLMEngine``) to the end and leave no trace of them."""
    long = min(LONG, engine.max_model_len // 2, engine.pool.num_blocks * engine.pool.block_size // 4)
    if long < 8:  # no room for the paths (a tiny context or cache): a first request compiles what it needs
        return
    short = min(SHORT, long // 2)
    params = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)

    def ids(n: int, salt: int) -> dict[str, list[int]]:
        return {"prompt_token_ids": [(salt + 7 * i) % engine.vocab_size for i in range(n)]}

    first = PREFIX + "0"
    engine.add_request(first, ids(long, 0), params)
    while not engine.requests[first].num_output_tokens:  # its prefill (alone), until a token has landed
        engine.step()
    engine.add_request(PREFIX + "1", ids(short, 1), params)  # beside the first one's decoding
    while engine.has_unfinished_requests():
        engine.step()
    engine.add_request(PREFIX + "2", ids(short, 2), params)  # two prompts in one step
    engine.add_request(PREFIX + "3", ids(short, 3), params)
    while engine.has_unfinished_requests():
        engine.step()
    for rid in [r for r in engine.requests if r.startswith(PREFIX)]:
        engine.drop_request(rid)
    _compile_masked_draws(engine)
    engine.reset_prefix_cache()
    engine.pool.queries = engine.pool.hits = 0
    engine.scheduler.num_preemptions = 0
    engine.scheduler.step_tokens = Buckets()
    engine.runner.reset_counters()
    engine.spec_stats = SpecDecodeStats(len(engine.spec_stats.accepted_per_position))


def _compile_masked_draws(engine: Any) -> None:
    """The greedy draw of constrained rows (``vtcore.kernels.masked_argmax``) in both the forms steps launch:
    a step's rows, and a late draw's with its two writes. The warm-up's requests are unconstrained (a grammar
    needs the tokenizer), and the kernel is not specialised on its shape, so one small call of each compiles
    what the first constrained request would otherwise stall its batch for."""
    if engine.device.type != "cuda":
        return
    import torch

    from vtcore.kernels.masked_argmax import masked_argmax

    logits = torch.zeros(1, 64, dtype=torch.float32, device=engine.device)
    words = torch.full((1, 2), -1, dtype=torch.int32, device=engine.device)
    target, index = torch.zeros(1, dtype=torch.int64, device=engine.device), torch.zeros(1, dtype=torch.int64,
                                                                                           device=engine.device)
    masked_argmax(logits, words)
    masked_argmax(logits, words, into=[(target, index), (target.clone(), index)])
