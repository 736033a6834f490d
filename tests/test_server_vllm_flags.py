"""vLLM's engine and server flags that command lines carry: ``--max-logprobs`` (the engine's cap on a request's
alternatives), ``--trust-remote-code`` (the tokenizer's), ``--root-path`` (a proxy's prefix: the guard and the
metrics see the route under it), ``--uvicorn-log-level`` and ``--enable-log-requests`` / ``--disable-log-requests``."""
from __future__ import annotations

import argparse
import io
import logging
from typing import Any

import pytest

from vtcore.config import EngineConfig
from server_harness import (API_KEY, MODEL, ServerThread, engine, httpx, metric,  # noqa: F401
                                  needs_default_model)
from vtcore import LLM, AsyncLLM, SamplingParams
from vtcore.engine.capacity import EngineLimits
from vtcore.server.app import build_app
from vtcore.server.protocol import CompletionRequest, bounded

pytestmark = needs_default_model


def _serve_args(*argv: str) -> argparse.Namespace:
    from vtcore.server.serve import add_serve_parser

    parser = argparse.ArgumentParser(prog="vtcore")
    add_serve_parser(parser.add_subparsers(dest="command", required=True))
    return parser.parse_args(["serve", *argv])


def test_max_logprobs_caps_a_requests_alternatives_and_minus_one_lifts_it() -> None:
    """vLLM's ``max_logprobs`` (default 20): more alternatives than it, or a request's -1 (the whole vocabulary)
    under a cap, are refused naming the field and the cap; ``max_logprobs=-1`` serves them."""
    capped = LLM(device="cpu", num_kv_blocks=32, max_logprobs=3)
    prompt = {"prompt_token_ids": [5, 6, 7]}
    out = capped.generate(prompt, SamplingParams(temperature=0, max_tokens=1, logprobs=3, prompt_logprobs=3))[0]
    assert len(out.outputs[0].logprobs[0]) >= 3
    for field, value in (("logprobs", 4), ("prompt_logprobs", 4), ("logprobs", -1)):
        with pytest.raises(ValueError, match=rf"SamplingParams\.{field}={value}: expected at most the engine's "
                                             r"max_logprobs, 3"):
            capped.generate(prompt, SamplingParams(temperature=0, max_tokens=1, **{field: value}))
    assert capped.generate(prompt, SamplingParams(temperature=0, max_tokens=1))[0].outputs[0].token_ids  # serving on

    assert EngineConfig().max_logprobs == 20
    with pytest.raises(ValueError, match=r"max_logprobs=-2: expected an integer >= 0, or -1 for no cap"):
        EngineConfig(max_logprobs=-2)
    assert _serve_args("--max-logprobs", "-1").max_logprobs == -1


def test_the_servers_prompt_logprobs_bound_is_the_engines_max_logprobs() -> None:
    """The request model, and so the OpenAPI document, bound ``prompt_logprobs`` by the engine's cap."""
    limits = EngineLimits(64, 1000, 4, 64, 16, 32)
    capped = bounded(CompletionRequest, EngineLimits(64, 1000, 4, 64, 16, 32, max_logprobs=5))
    assert capped.model_validate({"prompt": "a", "prompt_logprobs": 5}).prompt_logprobs == 5
    for value in (6, -1):
        with pytest.raises(ValueError, match="prompt_logprobs"):
            capped.model_validate({"prompt": "a", "prompt_logprobs": value})
    uncapped = bounded(CompletionRequest, limits)  # (EngineLimits' own default: -1, no cap)
    assert uncapped.model_validate({"prompt": "a", "prompt_logprobs": -1}).prompt_logprobs == -1
    schema = capped.model_json_schema()["properties"]["prompt_logprobs"]
    assert {"minimum": 0, "maximum": 5}.items() <= next(s for s in schema["anyOf"] if s.get("type") == "integer"
                                                        ).items()


def test_prompt_logprobs_minus_one_is_the_whole_vocabulary_where_uncapped() -> None:
    """``--max-logprobs -1`` lets a request ask ``prompt_logprobs: -1``: every position after the first holds the
    whole vocabulary (completions, with and without echo's logprobs; chat)."""
    uncapped = AsyncLLM(device="cpu", num_kv_blocks=64, max_logprobs=-1)
    try:
        vocab = uncapped.engine.vocab_size
        with ServerThread(build_app(uncapped, MODEL)) as srv:
            for extra in ({}, {"echo": True, "logprobs": 2}):
                body = {"prompt": [5, 6, 7], "max_tokens": 1, "prompt_logprobs": -1, **extra}
                got = httpx.post(srv.url + "/v1/completions", json=body).json()["choices"][0]["prompt_logprobs"]
                assert [None if p is None else len(p) for p in got] == [None, vocab, vocab], extra
            chat = httpx.post(srv.url + "/v1/chat/completions", json={
                "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1, "prompt_logprobs": -1}).json()
            assert {len(p) for p in chat["prompt_logprobs"][1:]} == {vocab}
    finally:
        uncapped.shutdown()


def test_trust_remote_code_fetches_a_hub_tokenizers_code(monkeypatch) -> None:
    """A hub id's snapshot holds no Python files unless remote code is trusted (its tokenizer class)."""
    import huggingface_hub

    from vtcore.loading.hub import resolve_model

    seen: list[list[str]] = []
    monkeypatch.setattr(huggingface_hub, "snapshot_download",
                        lambda model, allow_patterns, local_files_only: seen.append(allow_patterns) or "/snap")
    assert resolve_model("org/m", weights=False) == resolve_model("org/m", weights=False, code=True) == "/snap"
    assert "*.py" not in seen[0] and "*.py" in seen[1] and "*.safetensors" not in seen[1]


def test_trust_remote_code_reaches_the_tokenizer(monkeypatch) -> None:
    from transformers import AutoTokenizer

    from vtcore.config import DEFAULT_MODEL
    from vtcore.engine.tokenizer import engine_tokenizer

    seen: list[Any] = []
    monkeypatch.setattr(AutoTokenizer, "from_pretrained", lambda path, **kw: seen.append((path, kw)))
    engine_tokenizer(EngineConfig(trust_remote_code=True), DEFAULT_MODEL)
    engine_tokenizer(EngineConfig(), DEFAULT_MODEL)
    assert seen == [(DEFAULT_MODEL, {"trust_remote_code": True}), (DEFAULT_MODEL, {"trust_remote_code": False})]
    assert _serve_args("--trust-remote-code").trust_remote_code is True


def test_under_a_root_path_the_key_still_guards_and_metrics_name_the_route(engine: AsyncLLM) -> None:  # noqa: F811
    """uvicorn puts ``--root-path`` in front of every path; the routes, the API-key guard and the endpoint label
    of the HTTP counter must see the path under it, or /v1 would go unguarded."""
    auth = {"Authorization": f"Bearer {API_KEY}"}
    with ServerThread(build_app(engine, MODEL, api_key=API_KEY), root_path="/api") as srv:
        assert httpx.get(srv.url + "/v1/models").status_code == 401
        assert httpx.get(srv.url + "/v1/models", headers=auth).json()["data"][0]["id"] == MODEL
        assert httpx.get(srv.url + "/openapi.json").json()["servers"] == [{"url": "/api"}]
        text = httpx.get(srv.url + "/metrics").text
        assert metric(text, "vtcore:http_requests_total", endpoint="/v1/models", status="401") == 1
        assert metric(text, "vtcore:http_requests_total", endpoint="/v1/models", status="200") == 1
    for root in ("/api/", "/"):  # (uvicorn's path is then /api//v1/models: the guard strips the root as the router)
        with ServerThread(build_app(engine, MODEL, api_key=API_KEY), root_path=root) as srv:
            for path in ("/v1/models", "/%761/models"):
                assert httpx.get(srv.url + path).status_code == 401, (root, path)
            assert httpx.get(srv.url + "/v1/models", headers=auth).status_code == 200
    from vtcore.server.serve import cmd_serve

    with pytest.raises(ValueError, match="--root-path 'api': expected a URL path that starts with '/'"):
        cmd_serve(_serve_args("--root-path", "api"), io.StringIO())


def test_enable_log_requests_logs_each_request_as_it_comes_and_ends(engine: AsyncLLM, caplog,  # noqa: F811
                                                                    capsys) -> None:
    """``--enable-log-requests``: a line with the request's id, prompt length and params as it arrives, one
    with its finish reason and length as it ends; off (the default, and ``--disable-log-requests``), none."""
    caplog.set_level(logging.INFO, logger="vtcore.server.requests")
    for log_requests in (True, False):
        caplog.clear()
        with ServerThread(build_app(engine, MODEL, log_requests=log_requests)) as srv:
            body = httpx.post(srv.url + "/v1/completions", json={"prompt": [5, 6, 7], "max_tokens": 3,
                                                                  "temperature": 0, "ignore_eos": True}).json()
        lines = [r.getMessage() for r in caplog.records if r.name == "vtcore.server.requests"]
        if not log_requests:
            assert lines == []
            continue
        rid = f"{body['id']}-0"
        assert len(lines) == 2 and lines[0].startswith(f"Received request {rid}: 3 prompt tokens, params: ")
        assert "max_tokens=3" in lines[0]
        assert lines[1] == f"Finished request {rid}: length after 3 tokens"
    assert _serve_args("--enable-log-requests").enable_log_requests is True
    assert _serve_args().enable_log_requests is False
    assert _serve_args("--enable-log-requests", "--disable-log-requests").enable_log_requests is False
    assert "--disable-log-requests is deprecated" in capsys.readouterr().err
    assert _serve_args("--uvicorn-log-level", "trace").log_level == "trace"
