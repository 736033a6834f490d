"""The engine's front end (``vtcore.engine.front_end``) and the server's use of it: ``LLM`` and
``AsyncLLM`` tokenize, report their limits and load; the server runs on an ``AsyncLLM`` that shows
nothing but that front end (it once read the scheduler, the pool and private state), and runs a
prompt's ``n`` choices as one engine request (the engine's parallel sampling), not n of its own."""
from __future__ import annotations

import asyncio
from typing import Any, Iterator

import pytest
from server_harness import (KNOBS, MAX_BYTES, MODEL, PROMPTS, ServerThread, httpx, needs_default_model,
                            offline, openai, wait_pool_empty)

from vtcore import LLM, AsyncLLM, SamplingParams
from vtcore.engine.capacity import ITERATION_TOKEN_BUCKETS, EngineLimits, EngineStats
from vtcore.engine.front_end import EngineFrontEnd
from vtcore.server.app import build_app

pytestmark = needs_default_model

#: what a front end may use of an AsyncLLM
FRONT_END = {name for name in dir(EngineFrontEnd) if not name.startswith("_")} | {"generate", "abort", "healthy"}


class FrontEndOnly:
    """An ``AsyncLLM`` that shows only its front end (any other attribute raises), and records the
    requests it is given."""

    def __init__(self, engine: AsyncLLM) -> None:
        self._engine = engine
        self.generated: list[tuple[str, SamplingParams]] = []

    def __getattr__(self, name: str) -> Any:
        if name not in FRONT_END:
            raise AttributeError(f"the server used AsyncLLM.{name}, which is not the engine's front end")
        return getattr(self._engine, name)

    def generate(self, prompt: Any, params: SamplingParams, request_id: str, *, priority: int = 0) -> Any:
        self.generated.append((request_id, params))
        return self._engine.generate(prompt, params, request_id, priority=priority)


@pytest.fixture(scope="module")
def engine() -> Iterator[AsyncLLM]:
    eng = AsyncLLM(**KNOBS, max_num_seqs=64)
    yield eng
    eng.shutdown()


@pytest.fixture(scope="module")
def front_end(engine: AsyncLLM) -> FrontEndOnly:
    return FrontEndOnly(engine)


@pytest.fixture(scope="module")
def server(front_end: FrontEndOnly) -> Iterator[ServerThread]:
    with ServerThread(build_app(front_end, MODEL, None, MAX_BYTES)) as srv:  # type: ignore[arg-type]
        yield srv


def test_llm_and_async_llm_report_limits_load_and_tokens(engine: AsyncLLM, offline: LLM) -> None:
    for fe in (engine, offline):
        assert isinstance(fe, EngineFrontEnd)
        limits = fe.limits()
        assert isinstance(limits, EngineLimits) and (limits.num_kv_blocks, limits.block_size) == (512, 16)
        assert limits.vocab_size == len(fe.tokenizer) and limits.max_model_len == 1024
        assert limits.kv_blocks_needed(17) == 2
        text, ids = fe.tokenize(PROMPTS[0])
        assert text == PROMPTS[0] and fe.detokenize(ids) == PROMPTS[0]
        with pytest.raises(ValueError, match=r"token ids \[2048\]: outside the vocabulary"):
            fe.detokenize([5, limits.vocab_size])
        chat = fe.chat_prompt([{"role": "user", "content": "hi"}])
        assert fe.tokenize(chat["prompt"])[1] == chat["prompt_token_ids"]
    assert engine.limits().max_num_seqs == 64 and offline.limits().max_num_seqs == 256
    assert offline.stats() == EngineStats(0, 0, 0.0, 0, iteration_tokens=(0,) * (len(ITERATION_TOKEN_BUCKETS) + 1))


def test_stats_follow_a_running_request_and_healthy_ends_with_shutdown(tiny_checkpoint) -> None:
    async def main(eng: AsyncLLM) -> list[EngineStats]:
        seen = []
        params = SamplingParams(max_tokens=8, ignore_eos=True, n=3)
        async for _ in eng.generate({"prompt_token_ids": [5, 6, 7]}, params, "r"):
            seen.append(eng.stats())
        return seen

    eng = AsyncLLM(tiny_checkpoint[0], device="cpu", num_kv_blocks=16, block_size=16)
    assert eng.healthy
    seen = asyncio.run(main(eng))
    assert max(s.num_running for s in seen) == 3 and max(s.kv_cache_usage for s in seen) == 3 / 16
    # three samples looked up their 3-token prompt (shorter than a block: no hit)
    # and stepped: the three prompts in one step of 9 tokens (a bucket of at most 16), then 7 steps of a token a sample
    steps = (0, 7, 1) + (0,) * (len(ITERATION_TOKEN_BUCKETS) - 2)
    assert eng.stats() == EngineStats(0, 0, 0.0, 0, prefix_cache_queries=9, prefix_cache_hits=0,
                                      iteration_tokens=steps, iteration_tokens_sum=9 + 7 * 3)
    eng.shutdown()
    assert not eng.healthy


def test_the_server_needs_only_the_front_end(server: ServerThread, front_end: FrontEndOnly) -> None:
    with openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0, timeout=60) as client:
        assert client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=3).choices
        chunks = list(client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}],
                                                     max_tokens=3, stream=True))
        assert chunks[-1].choices[0].finish_reason is not None
        with pytest.raises(openai.BadRequestError):
            client.completions.create(model=MODEL, prompt=[5] * 2000, max_tokens=3)
        assert [m.id for m in client.models.list().data] == [MODEL]
    assert httpx.post(server.url + "/tokenize", json={"prompt": "hi"}).status_code == 200
    assert httpx.post(server.url + "/detokenize", json={"tokens": [5]}).status_code == 200
    assert httpx.get(server.url + "/health").status_code == 200
    assert "vtcore:num_requests_running" in httpx.get(server.url + "/metrics").text
    assert httpx.get(server.url + "/openapi.json").status_code == 200


def test_n_choices_are_one_engine_request_a_prompt(server: ServerThread, front_end: FrontEndOnly,
                                                   engine: AsyncLLM) -> None:
    front_end.generated.clear()
    with openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0, timeout=60) as client:
        r = client.completions.create(model=MODEL, prompt=PROMPTS[:2], max_tokens=4, n=3, temperature=1.0, seed=9,
                                      extra_body={"ignore_eos": True})
    assert [c.index for c in r.choices] == list(range(6))
    assert [params.n for _, params in front_end.generated] == [3, 3]
    assert len({rid for rid, _ in front_end.generated}) == 2
    wait_pool_empty(engine)
