"""vLLM's engine and server flags that command lines carry: ``--max-logprobs`` (the engine's cap on a request's
alternatives), ``--trust-remote-code`` (the tokenizer's), ``--root-path`` (a proxy's prefix: the guard and the
metrics see the route under it), ``--uvicorn-log-level``, ``--enable-log-requests`` / ``--disable-log-requests`` and
``--max-log-len``, ``--response-role``, ``--enable-force-include-usage``, and HTTPS (``--ssl-*``)."""
from __future__ import annotations

import argparse
import io
import json
import logging
import os
import ssl
from typing import Any

import jsonschema
import openai
import pytest

from vtcore.config import EngineConfig
from server_harness import (API_KEY, MODEL, ServerThread, engine, httpx, metric,  # noqa: F401
                                  needs_default_model, serve_in_thread)
from vtcore import LLM, AsyncLLM, SamplingParams
from vtcore.engine.capacity import EngineLimits
from vtcore.server.app import build_app
from vtcore.server.protocol import ChatCompletionRequest, CompletionRequest, bounded
from vtcore.server.responses_protocol import ResponsesRequest

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
    assert uncapped.model_validate({"prompt": "a", "prompt_logprobs": 1000}).prompt_logprobs == 1000
    with pytest.raises(ValueError, match="prompt_logprobs"):  # (no cap: still the vocabulary, as the engine checks;
        uncapped.model_validate({"prompt": "a", "prompt_logprobs": 1001})  # schemathesis found it unstated)
    assert next(s for s in uncapped.model_json_schema()["properties"]["prompt_logprobs"]["anyOf"]
                if s.get("type") == "integer")["maximum"] == 1000
    schema = capped.model_json_schema()["properties"]["prompt_logprobs"]
    assert {"minimum": 0, "maximum": 5}.items() <= next(s for s in schema["anyOf"] if s.get("type") == "integer"
                                                        ).items()


def test_a_sampled_tokens_alternatives_are_bounded_by_the_engines_max_logprobs_as_in_vllm() -> None:
    """Completions' ``logprobs`` and chat's and responses' ``top_logprobs`` take up to the engine's cap (vLLM's
    ``max_logprobs``, past OpenAI's 5 and 20), and the vocabulary without one; chat's -1 (the whole vocabulary)
    only without a cap, completions' never (vLLM refuses a negative ``logprobs``)."""
    capped, uncapped = (EngineLimits(64, 1000, 4, 64, 16, 32, max_logprobs=cap) for cap in (30, -1))
    chat = {"messages": [{"role": "user", "content": "a"}], "logprobs": True}
    cases = [(CompletionRequest, {"prompt": "a"}, "logprobs", False),
             (ChatCompletionRequest, chat, "top_logprobs", True),
             (ResponsesRequest, {"input": "a", "include": ["message.output_text.logprobs"]}, "top_logprobs", True)]
    for model, body, field, whole in cases:
        assert getattr(bounded(model, capped).model_validate({**body, field: 30}), field) == 30
        for value in (31, -1):
            with pytest.raises(ValueError, match=field):
                bounded(model, capped).model_validate({**body, field: value})
        free = bounded(model, uncapped)
        assert getattr(free.model_validate({**body, field: 1000}), field) == 1000
        with pytest.raises(ValueError, match=field):
            free.model_validate({**body, field: 1001})
        if whole:
            assert getattr(free.model_validate({**body, field: -1}), field) == -1
        else:
            with pytest.raises(ValueError, match=field):
                free.model_validate({**body, field: -1})
    with pytest.raises(ValueError, match="prompt_logprobs"):  # not served by the responses API: still refused
        bounded(ResponsesRequest, uncapped).model_validate({"input": "a", "prompt_logprobs": 3})
    # the document's rule as the endpoints': a top_logprobs other than 0 (-1 too) asks for the logprobs
    for model, body in ((ChatCompletionRequest, {"messages": chat["messages"]}), (ResponsesRequest, {"input": "a"})):
        schema = bounded(model, uncapped).model_json_schema()
        jsonschema.validate({**body, "top_logprobs": 0}, schema)
        for value in (-1, 3):
            with pytest.raises(jsonschema.ValidationError):
                jsonschema.validate({**body, "top_logprobs": value}, schema)


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
            chat = httpx.post(srv.url + "/v1/chat/completions", json={  # a sampled token's: chat's top_logprobs
                "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "logprobs": True,
                "top_logprobs": -1}).json()
            assert [len(t["top_logprobs"]) for t in chat["choices"][0]["logprobs"]["content"]] == [vocab, vocab]
            for path, body in (("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}),
                               ("/v1/responses", {"input": "hi"})):  # 0 asks for nothing (vLLM's rule), -1 for all
                assert httpx.post(srv.url + path, json={**body, "max_tokens": 1, "top_logprobs": 0}).status_code == 200
                refused = httpx.post(srv.url + path, json={**body, "max_tokens": 1, "top_logprobs": -1})
                assert refused.status_code == 400 and refused.json()["error"]["param"] == "top_logprobs", path
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
        assert len(lines) == 2 and lines[0].startswith(f"Received request {rid}: 3 prompt tokens, prompt: None, "
                                                       "params: ")
        assert "max_tokens=3" in lines[0] and lines[0].endswith(", prompt_token_ids: [5, 6, 7]")
        assert lines[1] == f"Finished request {rid}: length after 3 tokens"
    assert _serve_args("--enable-log-requests").enable_log_requests is True
    assert _serve_args().enable_log_requests is False
    assert _serve_args("--enable-log-requests", "--disable-log-requests").enable_log_requests is False
    assert "--disable-log-requests is deprecated" in capsys.readouterr().err
    assert _serve_args("--uvicorn-log-level", "trace").log_level == "trace"
    from vtcore.server.serve import access_log

    assert [access_log(_serve_args(*argv)) for argv in ([], ["--log-level", "debug"], ["--log-level", "trace"],
                                                        ["--log-level", "debug", "--disable-uvicorn-access-log"])] \
        == [False, True, True, False]


def test_max_log_len_cuts_the_logged_prompt(engine: AsyncLLM, caplog) -> None:  # noqa: F811
    """vLLM's ``--max-log-len``: a request's line shows its prompt's first N characters and ids."""
    caplog.set_level(logging.INFO, logger="vtcore.server.requests")
    with ServerThread(build_app(engine, MODEL, log_requests=True, max_log_len=4)) as srv:
        assert httpx.post(srv.url + "/v1/completions", json={"prompt": "Hello there, world", "max_tokens": 1}
                          ).status_code == 200
    (line,) = [r.getMessage() for r in caplog.records if r.getMessage().startswith("Received request")]
    ids = engine.tokenize("Hello there, world")[1]
    assert "prompt: 'Hell', params: " in line and line.endswith(f"prompt_token_ids: {ids[:4]}") and len(ids) > 4
    with pytest.raises(ValueError, match=r"max_log_len=-1: expected a number of characters and ids >= 0"):
        build_app(engine, MODEL, max_log_len=-1)
    from vtcore.server.serve import cmd_serve

    with pytest.raises(ValueError, match=r"--max-log-len -2: expected a number of characters and ids >= 0"):
        cmd_serve(_serve_args("--max-log-len", "-2"), io.StringIO())


def test_response_role_names_a_new_reply_and_a_continued_one_keeps_its_role(engine: AsyncLLM) -> None:  # noqa: F811
    """vLLM's ``--response-role`` and rule: a reply the prompt asks for (add_generation_prompt) has the server's role,
    streamed or not; one that continues the last message (continue_final_message) has that message's role."""
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2, "temperature": 0}
    with ServerThread(build_app(engine, MODEL, response_role="narrator")) as srv:
        whole = httpx.post(srv.url + "/v1/chat/completions", json=chat).json()
        assert whole["choices"][0]["message"]["role"] == "narrator"
        with httpx.stream("POST", srv.url + "/v1/chat/completions", json={**chat, "stream": True}) as r:
            first = next(line for line in r.iter_lines() if line.startswith("data: "))
        assert '"delta":{"role":"narrator","content":""}' in first.replace(" ", "")
        continued = {**chat, "messages": [{"role": "user", "content": "Say"}], "add_generation_prompt": False,
                     "continue_final_message": True}
        body = httpx.post(srv.url + "/v1/chat/completions", json=continued).json()
        assert body["choices"][0]["message"]["role"] == "user", body
    assert _serve_args().response_role == "assistant"
    with pytest.raises(ValueError, match=r"response_role='': expected a role name"):
        build_app(engine, MODEL, response_role="")


def test_force_include_usage_ends_every_stream_with_usage(engine: AsyncLLM) -> None:  # noqa: F811
    """vLLM's ``--enable-force-include-usage``: a streamed completion or chat that did not ask for usage still
    has it, in every chunk and in a last chunk (empty choices) before [DONE]; without the flag it does not."""
    completion = {"model": MODEL, "prompt": [5, 6, 7], "max_tokens": 3, "temperature": 0, "ignore_eos": True,
                  "stream": True}
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2, "temperature": 0,
            "stream": True}
    for force in (True, False):
        with ServerThread(build_app(engine, MODEL, force_include_usage=force)) as srv:
            for path, body in (("/v1/completions", completion), ("/v1/chat/completions", chat)):
                with httpx.stream("POST", srv.url + path, json=body) as r:
                    events = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
                assert events[-1] == "[DONE]"
                last = json.loads(events[-2])
                if force:  # (as vLLM's: the usage so far in every chunk too)
                    assert last["choices"] == [] and last["usage"]["completion_tokens"] == body["max_tokens"], last
                    assert all(json.loads(e)["usage"]["prompt_tokens"] > 0 for e in events[:-2])
                else:
                    assert last["choices"] and last.get("usage") is None, last
    assert _serve_args("--enable-force-include-usage").enable_force_include_usage is True


TLS = os.path.join(os.path.dirname(__file__), "fixture_tls")


def test_vtcore_serve_over_https_with_its_reply_flags(monkeypatch, tmp_path) -> None:
    """``vtcore serve --ssl-keyfile/--ssl-certfile`` (vLLM's): uvicorn serves HTTPS, which a client trusting the
    certificate reaches (the openai client included) and plain HTTP or an untrusting client do not; the command's
    ``--response-role`` and ``--enable-force-include-usage`` reach the app. A missing half, a file that is no key,
    or CA options without TLS are refused naming the flags, before the model loads."""
    from vtcore.engine import async_llm
    from vtcore.server import serve

    servers: list[Any] = []

    class Recorded(serve._server_class()):  # type: ignore[misc]
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            servers.append(self)

    monkeypatch.setattr(serve, "_server_class", lambda: Recorded)
    cert, key = os.path.join(TLS, "cert.pem"), os.path.join(TLS, "key.pem")
    args = _serve_args("--host", "127.0.0.1", "--port", "0", "--device", "cpu", "--log-level", "warning",
                       "--served-model-name", MODEL, "--shutdown-timeout", "0", "--no-engine-core-process",
                       "--ssl-keyfile", key, "--ssl-certfile", cert, "--response-role", "narrator",
                       "--enable-force-include-usage")
    thread, result, url = serve_in_thread(args)
    try:
        assert url.startswith("https://127.0.0.1:")
        trusting = httpx.Client(verify=ssl.create_default_context(cafile=cert))
        client = openai.OpenAI(base_url=url + "/v1", api_key="none", http_client=trusting)
        chunks = list(client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}],
                                                     max_tokens=2, temperature=0, stream=True))
        assert chunks[0].choices[0].delta.role == "narrator"
        assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 2  # (usage not asked for)
        with pytest.raises(httpx.HTTPError):
            httpx.get(url.replace("https://", "http://") + "/v1/models", timeout=5)  # (plain HTTP to a TLS port)
        with pytest.raises(httpx.ConnectError):
            httpx.get(url + "/v1/models", timeout=5)  # (a client that does not trust the certificate)
    finally:
        servers[0].should_exit = True
        thread.join(30)
    assert result["rc"] == 0
    assert serve._tls_options(_serve_args()) == {}
    both = tmp_path / "both.pem"  # (a certificate file that holds its key too, as uvicorn takes it)
    both.write_text(open(key).read() + open(cert).read())
    assert serve._tls_options(_serve_args("--ssl-certfile", str(both)))["ssl_keyfile"] is None

    def no_model(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("the model was loaded before the flags were checked")

    monkeypatch.setattr(async_llm, "AsyncLLM", no_model)
    for argv, message in (
            (["--ssl-keyfile", key], "--ssl-keyfile: expected with --ssl-certfile"),
            (["--ssl-certfile", key], f"--ssl-certfile '{key}': cannot be used"),
            (["--ssl-ca-certs", cert], "--ssl-ca-certs and --ssl-cert-reqs: expected with --ssl-certfile"),
            (["--ssl-keyfile", cert, "--ssl-certfile", cert], f"--ssl-certfile '{cert}' --ssl-keyfile '{cert}': "
                                                               "cannot be used"),
            (["--response-role", ""], "--response-role '': expected a role name")):
        with pytest.raises(ValueError, match=message):
            serve.cmd_serve(_serve_args(*argv), io.StringIO())


def test_max_tokens_follows_vllms_rule_over_the_generation_config(tmp_path, default_model_with) -> None:
    """vLLM's rule for a served request's max_tokens: its own, else the defaults' (generation_config.json's
    max_new_tokens), then at most the cap: ``override_generation_config``'s max_new_tokens, or, with
    ``generation_config`` a folder, that folder's."""
    path = default_model_with(max_new_tokens=3)
    folder = tmp_path / "gen"
    folder.mkdir()
    (folder / "generation_config.json").write_text(json.dumps({"max_new_tokens": 2}))
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "temperature": 0, "ignore_eos": True}
    completion = {"model": MODEL, "prompt": [5, 6, 7], "max_tokens": 6, "temperature": 0, "ignore_eos": True}
    cases = [({}, 3, 6),  # the checkpoint's 3 where the chat leaves max_tokens out; no cap on the 6 asked
             ({"override_generation_config": {"max_new_tokens": 4}}, 4, 4),  # the override's 4: default and cap
             ({"generation_config": str(folder)}, 2, 2)]  # the folder's 2: default and cap
    for knobs, chat_tokens, completion_tokens in cases:
        served = AsyncLLM(path, device="cpu", num_kv_blocks=64, **knobs)
        try:
            with ServerThread(build_app(served, MODEL)) as srv:
                got = [httpx.post(srv.url + "/v1/chat/completions", json=chat).json()["usage"]["completion_tokens"],
                       httpx.post(srv.url + "/v1/completions", json=completion).json()["usage"]["completion_tokens"]]
        finally:
            served.shutdown()
        assert got == [chat_tokens, completion_tokens], knobs
