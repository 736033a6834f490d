"""vLLM's prefix-cache reset on the async engine and over HTTP: ``AsyncLLM.reset_prefix_cache`` between the
engine thread's steps, and ``POST /reset_prefix_cache`` mounted in development mode only (as vLLM mounts it
under ``VLLM_SERVER_DEV_MODE``), guarded by the API key, its query flags checked. The engine core process's
reset is in ``tests/test_engine_core_process.py``."""
from __future__ import annotations

import asyncio
from typing import Any, Iterator

import pytest

from tests.server_harness import API_KEY, KNOBS, MAX_BYTES, MODEL, ServerThread, engine, httpx, needs_default_model
from vtcore import AsyncLLM, SamplingParams
from vtcore.server.app import build_app

pytestmark = needs_default_model
__all__ = ["engine"]  # (the module fixture this file uses)
PROMPT = {"prompt_token_ids": list(range(100, 140))}  # 40 ids: two full 16-token blocks can be reused


async def cached_tokens(llm: AsyncLLM, rid: str) -> int:
    params = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
    outs = [out async for out in llm.generate(PROMPT, params, rid)]
    return outs[-1].num_cached_tokens


def test_a_reset_forgets_what_the_next_request_would_reuse(engine: AsyncLLM) -> None:
    async def main() -> list[Any]:
        warm = await cached_tokens(engine, "warm")
        hit = await cached_tokens(engine, "hit")
        caching = await engine.reset_prefix_cache()
        after = await cached_tokens(engine, "after")
        again = await cached_tokens(engine, "again")
        return [warm, hit, caching, after, again]

    warm, hit, caching, after, again = asyncio.run(main())
    assert hit == 32 and caching is True and after == 0 and again == 32, (warm, hit, caching, after, again)


def test_a_reset_while_a_request_runs_keeps_it_running(engine: AsyncLLM) -> None:
    async def main() -> tuple[list[int], list[int]]:
        params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
        ref = [o async for o in engine.generate(PROMPT, params, "ref")][-1].outputs[0].token_ids
        gen = engine.generate(PROMPT, params, "running")
        await gen.__anext__()
        await engine.reset_prefix_cache()
        outs = [o async for o in gen]
        return ref, outs[-1].outputs[0].token_ids

    ref, got = asyncio.run(main())
    assert got == ref


@pytest.fixture(scope="module")
def dev_server(engine: AsyncLLM) -> Iterator[ServerThread]:
    with ServerThread(build_app(engine, MODEL, None, MAX_BYTES, dev_mode=True)) as srv:
        yield srv


def _usage_cached(url: str, **kw: Any) -> int:
    body = {"model": MODEL, "prompt": PROMPT["prompt_token_ids"], "max_tokens": 2, "temperature": 0}
    r = httpx.post(url + "/v1/completions", json=body, timeout=60, **kw)
    assert r.status_code == 200, r.text
    return r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]


def test_the_endpoint_resets_in_dev_mode(dev_server: ServerThread) -> None:
    _usage_cached(dev_server.url)
    assert _usage_cached(dev_server.url) == 32
    r = httpx.post(dev_server.url + "/reset_prefix_cache", timeout=30)
    assert r.status_code == 200 and r.content == b""
    assert _usage_cached(dev_server.url) == 0
    r = httpx.post(dev_server.url + "/reset_prefix_cache?reset_running_requests=true&reset_external=false", timeout=30)
    assert r.status_code == 200
    assert _usage_cached(dev_server.url) == 0
    bad = httpx.post(dev_server.url + "/reset_prefix_cache?reset_running_requests=maybe", timeout=30)
    assert bad.status_code == 400 and "reset_running_requests" in bad.json()["error"]["message"], bad.text
    assert httpx.get(dev_server.url + "/reset_prefix_cache", timeout=30).status_code == 405
    assert "/reset_prefix_cache" in httpx.get(dev_server.url + "/openapi.json", timeout=30).json()["paths"]


def test_the_endpoint_is_absent_outside_dev_mode_and_keyed_when_a_key_is_set(engine: AsyncLLM) -> None:
    with ServerThread(build_app(engine, MODEL, None, MAX_BYTES)) as plain:
        r = httpx.post(plain.url + "/reset_prefix_cache", timeout=30)
        assert r.status_code == 404 and r.json()["error"]["code"] == "not_found"
    with ServerThread(build_app(engine, MODEL, API_KEY, MAX_BYTES, dev_mode=True)) as keyed:
        assert httpx.post(keyed.url + "/reset_prefix_cache", timeout=30).status_code == 401
        ok = httpx.post(keyed.url + "/reset_prefix_cache", headers={"Authorization": f"Bearer {API_KEY}"}, timeout=30)
        assert ok.status_code == 200


@pytest.mark.parametrize("env,expected", [("1", True), ("0", False), (None, False)])
def test_serve_mounts_it_under_the_dev_mode_variable(monkeypatch: pytest.MonkeyPatch, env: str | None,
                                                     expected: bool) -> None:
    """``vtcore serve`` reads ``VTCORE_SERVER_DEV_MODE`` (vLLM's ``VLLM_SERVER_DEV_MODE``) into ``build_app``."""
    import io

    import vtcore.server.app
    from vtcore.cli.main import build_parser

    seen: dict[str, Any] = {}

    class Built(Exception):
        pass

    def fake_build_app(*args: Any, **kwargs: Any) -> None:
        seen.update(kwargs)
        raise Built

    monkeypatch.setattr(vtcore.server.app, "build_app", fake_build_app)
    if env is None:
        monkeypatch.delenv("VTCORE_SERVER_DEV_MODE", raising=False)
    else:
        monkeypatch.setenv("VTCORE_SERVER_DEV_MODE", env)
    args = build_parser().parse_args(["serve", "--device", "cpu", "--port", "0", "--no-engine-core-process",
                                      "--num-kv-blocks", "64"])
    with pytest.raises(Built):
        args.func(args, io.StringIO())
    assert seen["dev_mode"] is expected


def test_a_call_queued_at_shutdown_is_answered_or_refused_never_left_waiting() -> None:
    from vtcore.errors import EngineDeadError

    llm = AsyncLLM(**KNOBS)

    async def main() -> Any:
        params = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)
        gen = llm.generate(PROMPT, params, "long")
        await gen.__anext__()
        pending = asyncio.ensure_future(llm.reset_prefix_cache())
        await asyncio.sleep(0)
        await asyncio.get_running_loop().run_in_executor(None, llm.shutdown)
        try:
            return await asyncio.wait_for(pending, 10)
        except EngineDeadError as exc:
            return exc
        finally:
            await gen.aclose()

    answer = asyncio.run(main())
    assert answer is True or "shut down" in str(answer), answer
