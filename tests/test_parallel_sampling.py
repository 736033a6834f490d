"""``SamplingParams.n > 1`` (vLLM's parallel sampling): n samples of one prompt, reported under the
request's id with completion indices 0..n-1; sample i is the request with seed ``seed + i``."""
from __future__ import annotations

import asyncio

import pytest

from vtcore import LLM, AsyncLLM, SamplingParams
from vtcore.sampling_params import RequestOutputKind

PROMPT = {"prompt_token_ids": [5, 17, 3, 9]}
KNOBS = dict(device="cpu", max_model_len=64, num_kv_blocks=16, block_size=16)


def sampled(**kw) -> SamplingParams:
    return SamplingParams(**{"temperature": 1.0, "max_tokens": 6, "ignore_eos": True, "seed": 11, **kw})


@pytest.fixture(scope="module")
def llm(tiny_checkpoint) -> LLM:
    return LLM(tiny_checkpoint[0], **KNOBS)


def test_n_samples_equal_the_seeded_single_requests(llm: LLM) -> None:
    """Each sample is the single request with its seed; the n come back as one output, in index order,
    the prompt's logprobs once (sample 0's)."""
    [out] = llm.generate(PROMPT, sampled(n=3, logprobs=2, prompt_logprobs=1))
    singles = llm.generate([PROMPT] * 3, [sampled(seed=11 + i, logprobs=2, prompt_logprobs=1) for i in range(3)])
    assert out.finished and [c.index for c in out.outputs] == [0, 1, 2]
    for c, single in zip(out.outputs, singles):
        assert c.token_ids == single.outputs[0].token_ids and c.finish_reason == "length"
        assert c.cumulative_logprob == pytest.approx(single.outputs[0].cumulative_logprob)
    assert len({tuple(c.token_ids) for c in out.outputs}) > 1  # different seeds, different samples
    assert out.prompt_token_ids == PROMPT["prompt_token_ids"] and out.prompt_logprobs == singles[0].prompt_logprobs
    with pytest.raises(ValueError, match=r"^SamplingParams.n=2: expected 1 with greedy sampling \(temperature=0.0\)"):
        SamplingParams(temperature=0.0, n=2)  # (vLLM's rule: n copies of one greedy sample)
    assert llm.engine.requests == {} and llm.engine.fanouts == {}


@pytest.mark.parametrize("kind", [RequestOutputKind.CUMULATIVE, RequestOutputKind.DELTA])
def test_streamed_samples_report_what_changed(llm: LLM, kind: RequestOutputKind) -> None:
    """Streamed: each step's output holds the completions that changed, by index; only the last is
    finished; deltas add up to the final tokens, cumulative outputs only grow."""
    engine = llm.engine
    a, b = (c.token_ids for c in llm.generate(PROMPT, sampled(n=2))[0].outputs)
    stop = next(t for t in a[:-1] if t not in b)  # sample 0 stops early on it, sample 1 runs on
    engine.add_request("p", PROMPT, sampled(n=2, output_kind=kind, stop_token_ids=[stop]))
    seen: dict[int, list[int]] = {0: [], 1: []}
    outs = []
    while engine.has_unfinished_requests():
        outs += engine.step()
    assert outs and all(o.request_id == "p" for o in outs)
    assert outs[-1].finished and not any(o.finished for o in outs[:-1])
    done = set()
    for o in outs:
        for c in o.outputs:
            assert c.index not in done  # a finished sample is not reported again
            if kind == RequestOutputKind.DELTA:
                seen[c.index] += c.token_ids
            else:
                assert c.token_ids[:len(seen[c.index])] == seen[c.index]
                seen[c.index] = list(c.token_ids)
            if c.finish_reason is not None:
                done.add(c.index)
    assert seen == {0: a[:a.index(stop) + 1], 1: b} and done == {0, 1}
    assert engine.requests == {} and engine.fanouts == {}


def test_abort_stops_every_sample_and_ids_do_not_collide(llm: LLM) -> None:
    engine = llm.engine
    engine.add_request("a", PROMPT, sampled(n=3, max_tokens=40))
    engine.step()
    engine.abort_request("a")
    outs = []
    while engine.has_unfinished_requests():
        outs += engine.step()
    assert outs[-1].finished and {c.finish_reason for o in outs for c in o.outputs} == {"abort"}
    assert engine.requests == {} and engine.fanouts == {} and engine.pool.num_free == engine.pool.num_blocks
    engine.add_request("1_b", PROMPT, sampled())  # sample 1 of a request "b" would take this id
    with pytest.raises(ValueError, match=r"request_id='b': its sample 1's id '1_b' is already in use"):
        engine.add_request("b", PROMPT, sampled(n=2))
    assert set(engine.requests) == {"1_b"} and engine.fanouts == {}  # sample 0 added, then dropped
    engine.drop_request("1_b")
    assert engine.requests == {} and not engine.has_unfinished_requests()


def test_async_llm_streams_n_samples(tiny_checkpoint, llm: LLM) -> None:
    async def main():
        engine = AsyncLLM(tiny_checkpoint[0], **KNOBS)
        try:
            return [o async for o in engine.generate(PROMPT, sampled(n=2), "r")]
        finally:
            engine.shutdown()

    stream = asyncio.run(main())
    assert stream[-1].finished and not any(o.finished for o in stream[:-1])
    last = {}
    for o in stream:
        last.update({c.index: c.token_ids for c in o.outputs})
    assert last == {c.index: c.token_ids for c in llm.generate(PROMPT, sampled(n=2))[0].outputs}


def test_sample_params() -> None:
    """Sample i: n=1, seed + i, wrapped into torch's seed range; unseeded stays unseeded; a bad index
    is named."""
    assert sampled(n=4).sample(2) == sampled(n=1, seed=13)
    assert SamplingParams(seed=2 ** 64 - 1, n=3).sample(2).seed == 1
    assert SamplingParams(n=2).sample(1).seed is None
    for bad in (-1, 1.0, "1"):
        with pytest.raises(ValueError, match=rf"SamplingParams.sample\(index={bad!r}\): expected an integer >= 0"):
            SamplingParams(n=2).sample(bad)
