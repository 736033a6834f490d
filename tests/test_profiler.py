"""vLLM's ``start_profile`` / ``stop_profile``: ``LLM``, ``AsyncLLM`` (engine thread and core process) and the
server's routes write a torch.profiler trace of the steps between them, with the forward's operators (run on
the CPU worker thread here); the routes exist only with ``profiler_config``; misuse says what is wrong."""
from __future__ import annotations

import asyncio
import gzip
import json
import os
from typing import Any

import pytest

from tests.server_harness import API_KEY, KNOBS, MAX_BYTES, MODEL, ServerThread, httpx, needs_default_model
from vtcore import LLM, AsyncLLM, SamplingParams
from vtcore.config import ProfilerConfig
from vtcore.server.app import build_app

pytestmark = needs_default_model
PARAMS = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)


def _operators(path: str) -> set[str]:
    with gzip.open(path, "rt") as f:
        return {e.get("name", "") for e in json.load(f)["traceEvents"]}


def _config(tmp_path: Any) -> dict[str, str]:
    return {"profiler": "torch", "torch_profiler_dir": str(tmp_path / "traces")}


def test_llm_writes_a_trace_of_the_steps_between_start_and_stop(tmp_path: Any) -> None:
    llm = LLM(**KNOBS, profiler_config=json.dumps(_config(tmp_path)))
    try:
        with pytest.raises(RuntimeError, match="no profile is recording; start_profile first"):
            llm.stop_profile()
        llm.start_profile()
        with pytest.raises(RuntimeError, match="already recording"):
            llm.start_profile()
        llm.generate("The meaning of life is", PARAMS)
        path = llm.stop_profile()
        llm.generate("The meaning of life is", PARAMS)  # not recorded: no trace grows
        llm.start_profile()
        second = llm.stop_profile()
    finally:
        llm.shutdown()
    assert os.path.dirname(path) == str(tmp_path / "traces") and path != second
    assert path.endswith(".pt.trace.json.gz") and sorted(os.listdir(tmp_path / "traces")) == sorted(
        [os.path.basename(path), os.path.basename(second)])
    ops = _operators(path)
    assert any(op.startswith("aten::") and ("mm" in op or "linear" in op) for op in ops), sorted(ops)[:30]
    assert not any("mm" in op or "linear" in op for op in _operators(second))


def test_without_a_profiler_config_start_says_how_to_get_one() -> None:
    llm = LLM(**KNOBS)
    try:
        with pytest.raises(RuntimeError, match=r'profiler_config=\{"profiler": "torch", "torch_profiler_dir"'):
            llm.start_profile()
    finally:
        llm.shutdown()


@pytest.mark.parametrize("value,message", [
    ("{", "not valid JSON"), ([1], "expected a dict"), ({"profiler": "nsys", "torch_profiler_dir": "x"}, "'torch'"),
    ({"profiler": "torch"}, "torch_profiler_dir=None"), ({"profiler": "torch", "torch_profiler_dir": "x", "y": 1},
                                                         r"unknown key\(s\) \['y'\]")])
def test_a_bad_profiler_config_is_named(value: Any, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        ProfilerConfig.parse(value)


@pytest.mark.parametrize("core_process", [False, True])
def test_async_engines_profile_between_steps(tmp_path: Any, core_process: bool) -> None:
    llm = AsyncLLM(**KNOBS, profiler_config=_config(tmp_path), engine_core_process=core_process)

    async def main() -> str:
        with pytest.raises(RuntimeError, match="no profile is recording"):
            await llm.stop_profile()
        await llm.start_profile()
        outs = [o async for o in llm.generate("A friend is", PARAMS, "p")]
        assert outs[-1].finished
        return await llm.stop_profile()

    try:
        path = asyncio.run(main())
    finally:
        llm.shutdown()
    assert any("mm" in op or "linear" in op for op in _operators(path))


def test_the_server_routes_exist_with_a_profiler_only(tmp_path: Any) -> None:
    engine = AsyncLLM(**KNOBS, profiler_config=_config(tmp_path))
    plain = AsyncLLM(**KNOBS)
    try:
        with ServerThread(build_app(engine, MODEL, API_KEY, MAX_BYTES)) as srv:
            auth = {"Authorization": f"Bearer {API_KEY}"}
            assert httpx.post(srv.url + "/start_profile", timeout=30).status_code == 401
            assert httpx.post(srv.url + "/stop_profile", headers=auth, timeout=30).status_code == 409
            r = httpx.post(srv.url + "/start_profile", headers=auth, timeout=30)
            assert r.status_code == 200 and r.content == b""
            again = httpx.post(srv.url + "/start_profile", headers=auth, timeout=30)
            assert again.status_code == 409 and "already recording" in again.json()["error"]["message"]
            body = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 3, "temperature": 0}
            assert httpx.post(srv.url + "/v1/completions", json=body, headers=auth, timeout=60).status_code == 200
            assert httpx.post(srv.url + "/stop_profile", headers=auth, timeout=60).status_code == 200
            paths = httpx.get(srv.url + "/openapi.json", timeout=30).json()["paths"]
            assert "/start_profile" in paths and "/stop_profile" in paths
        (trace,) = os.listdir(tmp_path / "traces")
        assert any("mm" in op or "linear" in op for op in _operators(str(tmp_path / "traces" / trace)))
        with ServerThread(build_app(plain, MODEL, None, MAX_BYTES)) as srv:
            assert httpx.post(srv.url + "/start_profile", timeout=30).status_code == 404
    finally:
        engine.shutdown()
        plain.shutdown()


def test_two_engines_of_one_process_write_apart_one_at_a_time(tmp_path: Any) -> None:
    llms = [LLM(**KNOBS, profiler_config=_config(tmp_path)) for _ in range(2)]
    try:
        paths = []
        for llm in llms:
            llm.start_profile()
            with pytest.raises(RuntimeError, match="another engine of this process is recording"):
                llms[1 - llms.index(llm)].start_profile()
            paths.append(llm.stop_profile())
    finally:
        for llm in llms:
            llm.shutdown()
    assert len(set(paths)) == 2 and len(os.listdir(tmp_path / "traces")) == 2


def test_calls_from_two_threads_get_their_own_answers(tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """The core answers calls in the order they reach the pipe; a call whose sending is slow (here: held 0.3 s, as
    a thread switch may hold it) must still get its own answer, not the next caller's."""
    import threading
    import time

    llm = AsyncLLM(**KNOBS, profiler_config=_config(tmp_path), engine_core_process=True)
    send = llm.core.send

    def slow_send(msg: tuple) -> None:
        if msg == ("call", "stop_profile"):
            time.sleep(0.3)
        send(msg)

    monkeypatch.setattr(llm.core, "send", slow_send)
    answers: dict[str, Any] = {}

    def call(name: str, delay: float) -> None:
        time.sleep(delay)
        answers[name] = asyncio.run(getattr(llm, name)())

    try:
        asyncio.run(llm.start_profile())
        threads = [threading.Thread(target=call, args=("stop_profile", 0)),
                   threading.Thread(target=call, args=("reset_prefix_cache", 0.1))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
    finally:
        llm.shutdown()
    assert answers["reset_prefix_cache"] is True and str(answers["stop_profile"]).endswith(".pt.trace.json.gz")


def test_a_dead_engine_is_a_500_not_a_conflict(tmp_path: Any) -> None:
    engine = AsyncLLM(**KNOBS, profiler_config=_config(tmp_path))
    with ServerThread(build_app(engine, MODEL, None, MAX_BYTES)) as srv:
        engine.shutdown()
        for path in ("/start_profile", "/stop_profile"):
            r = httpx.post(srv.url + path, timeout=30)
            assert r.status_code == 500 and r.json()["error"]["code"] == "engine_dead", r.text
