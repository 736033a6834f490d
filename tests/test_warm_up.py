"""The engine's GPU warm-up (``vtcore.engine.warm_up``), run here on the CPU engine: it takes the paths a
served load takes, and leaves no request, cached block or counter behind."""
from __future__ import annotations

import pytest

from vtcore import LLM, SamplingParams
from vtcore.engine.warm_up import LONG, PREFIX, warm_up

KNOBS = dict(device="cpu", block_size=4, num_kv_blocks=400, max_num_seqs=8)


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_the_warm_up_takes_the_served_paths_and_leaves_no_trace(tiny_checkpoint, async_scheduling):
    llm = LLM(tiny_checkpoint[0], async_scheduling=async_scheduling, **KNOBS)
    engine = llm.engine
    batches = []
    schedule = engine.scheduler.schedule

    def observed():
        batch = schedule()
        batches.append([(s.request.request_id, s.num_tokens) for s in batch])
        return batch
    engine.scheduler.schedule = observed
    warm_up(engine)
    del engine.scheduler.schedule
    long = min(LONG, engine.max_model_len // 2, 400 * 4 // 4)
    assert any(n == long for b in batches for _, n in b)  # the long prompt in one step
    # a short prompt beside a decoding request, and two prompts in one step
    assert any(len(b) == 2 and sorted(n for _, n in b)[0] == 1 and sorted(n for _, n in b)[1] > 1 for b in batches)
    assert any(len(b) == 2 and all(n > 1 for _, n in b) for b in batches)
    assert not engine.requests and not engine.has_unfinished_requests()
    stats = engine.stats()
    assert (stats.prefix_cache_queries, stats.prefix_cache_hits, stats.num_preemptions) == (0, 0, 0)
    assert (sum(stats.iteration_tokens), stats.iteration_tokens_sum) == (0, 0)  # its steps are not the engine's
    runner = engine.runner  # the paths it took are not counted as the checks' own
    assert (runner.padded_decode_steps, runner.stale_forwards, runner.consuming_forwards) == (0, 0, 0)

    # the warm-up's long prompt again: nothing of it is cached, and the tokens are a fresh engine's
    prompt = {"prompt_token_ids": [(7 * i) % engine.vocab_size for i in range(long)]}
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    (out,) = llm.generate(prompt, params)
    assert out.num_cached_tokens == 0 and not out.request_id.startswith(PREFIX)
    fresh = LLM(tiny_checkpoint[0], async_scheduling=async_scheduling, **KNOBS)
    assert out.outputs[0].token_ids == fresh.generate(prompt, params)[0].outputs[0].token_ids


def test_no_warm_up_where_the_cache_holds_too_little(tiny_checkpoint):
    llm = LLM(tiny_checkpoint[0], **{**KNOBS, "num_kv_blocks": 7})  # 28 tokens: a 7-token prompt at most
    steps = llm.engine.runner.steps_submitted
    warm_up(llm.engine)
    assert llm.engine.runner.steps_submitted == steps
