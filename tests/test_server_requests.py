"""Request values that outside clients sent and the server once mishandled: each is now answered as
OpenAI answers it (a 400 naming the field, or the right text), and the server keeps serving."""
from __future__ import annotations

import logging
import time
from typing import Any, Iterator

import pytest
from fastapi import BackgroundTasks, Request, Response
from pydantic import BaseModel
from server_harness import (MODEL, PROMPTS, ServerThread, client, engine, error_of,  # noqa: F401
                            needs_default_model, openai, post_json, server)

pytestmark = needs_default_model


class Records(logging.Handler):
    """Keeps every record logged (those with a traceback in ``tracebacks``)."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)

    @property
    def tracebacks(self) -> list[str]:
        return [self.format(r) for r in self.records if r.exc_info]


@pytest.fixture
def server_log() -> Iterator[Records]:
    """What uvicorn and vtcore log meanwhile (uvicorn's loggers do not reach pytest's capture)."""
    handler = Records()
    loggers = [logging.getLogger(name) for name in ("uvicorn", "uvicorn.error", "vtcore")]
    for lg in loggers:
        lg.addHandler(handler)
    yield handler
    for lg in loggers:
        lg.removeHandler(handler)


def assert_400(r: Any, param: str) -> dict[str, Any]:
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and err["type"] == "invalid_request_error", err
    return err


def test_n_is_capped_at_128(server: ServerThread, client: Any) -> None:
    """n=100000 was taken: the server stalled for 50 s queueing requests and grew memory."""
    started = time.monotonic()
    with pytest.raises(openai.BadRequestError) as exc:
        client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=1, n=100000)
    assert error_of(exc.value)["param"] == "n" and "128" in error_of(exc.value)["message"]
    with pytest.raises(openai.BadRequestError) as exc:
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=1, n=129)
    assert error_of(exc.value)["param"] == "n"
    assert time.monotonic() - started < 5
    r = client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=1, n=128, temperature=1.0, seed=3)
    assert [c.index for c in r.choices] == list(range(128))


@pytest.mark.parametrize("bias", [float("nan"), float("inf"), float("-inf")])
def test_non_finite_logit_bias_is_refused(server: ServerThread, bias: float) -> None:
    """NaN and infinities (JSON's NaN / Infinity, which Python's json writes) were clamped to +100:
    NaN forced the token."""
    r = post_json(server.url + "/v1/completions", {"model": MODEL, "prompt": PROMPTS[0], "max_tokens": 2,
                                                   "logit_bias": {"35": bias}})
    err = assert_400(r, "logit_bias")
    assert "finite" in err["message"]


@pytest.mark.parametrize("path, body, param", [
    ("/v1/completions", {"prompt": "a\ud800b"}, "prompt"),
    ("/v1/completions", {"prompt": ["fine", "a\udfffb"]}, "prompt"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "a\ud800b"}]}, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [{"type": "text", "text": "\ud83d"}]}]},
     "messages"),
    ("/tokenize", {"prompt": "a\ud800b"}, "prompt"),
])
def test_a_lone_surrogate_is_a_400_naming_the_field_without_a_traceback(server: ServerThread, server_log: Records,
                                                                         path: str, body: dict, param: str) -> None:
    """JSON's "\\ud800" is a string no tokenizer takes: it was a 400 with param null and the
    tokenizer's TypeError, and the server logged "Exception in ASGI application" with a traceback."""
    r = post_json(server.url + path, {"model": MODEL, "max_tokens": 2, **body})
    time.sleep(0.3)  # uvicorn logs an escaped exception after the response has gone out
    assert server_log.tracebacks == []
    assert "lone surrogate" in assert_400(r, param)["message"]
    assert post_json(server.url + path, {"model": MODEL, "max_tokens": 2, **{
        k: "fine" if k == "prompt" else [{"role": "user", "content": "fine"}] for k in body}}).status_code == 200


@pytest.mark.parametrize("message", [{"role": "user"}, {"role": "user", "content": None}])
def test_a_chat_message_without_content_is_refused(client: Any, message: dict) -> None:
    """It was taken as an empty message."""
    with pytest.raises(openai.BadRequestError) as exc:
        client.chat.completions.create(model=MODEL, messages=[message], max_tokens=2)
    err = error_of(exc.value)
    assert err["param"] == "messages" and err["message"].startswith("messages[0].content: "), err


def _two_stops_in_one_token(client: Any) -> tuple[str, str, str, int]:
    """(text, stop a, stop b, where a is) of a greedy completion: a and b overlap inside one token's
    text, a first, and appear nowhere before it, so one step sees both."""
    r = client.completions.create(model=MODEL, prompt=PROMPTS[2], max_tokens=40, temperature=0, logprobs=0,
                                  extra_body={"ignore_eos": True})
    text, pos = r.choices[0].text, 0
    for piece in r.choices[0].logprobs.tokens:
        if not piece or not text.startswith(piece, pos):
            continue  # a special token: not in the text
        for i in range(len(piece) - 2):
            a, b = piece[i:i + 2], piece[i + 1:i + 3]
            if text.find(a) == pos + i and text.find(b) == pos + i + 1:
                return text, a, b, pos + i
        pos += len(piece)
    pytest.fail(f"no token of {text!r} holds two overlapping 2-character strings seen nowhere before")


def test_several_stop_strings_cut_at_the_first_to_appear(client: Any) -> None:
    """With stop=[b, a] and one token holding a, then b (overlapping it), the output stopped at b, the
    first in the list, and so held a's first character."""
    text, a, b, at = _two_stops_in_one_token(client)
    kw = dict(model=MODEL, prompt=PROMPTS[2], max_tokens=40, temperature=0, stop=[b, a],
              extra_body={"ignore_eos": True})
    choice = client.completions.create(**kw).choices[0]
    assert (choice.text, choice.finish_reason, choice.model_extra["stop_reason"]) == (text[:at], "stop", a)
    streamed = list(client.completions.create(stream=True, **kw))
    assert "".join(c.choices[0].text for c in streamed) == text[:at]


def test_token_id_completions_are_prepared_on_the_event_loop_and_text_on_a_preparing_thread(
        server: ServerThread, monkeypatch: Any) -> None:
    """A completion of token ids has nothing to tokenize: it is checked on the event loop (a hop to a
    preparing thread cost more than the checks); text (and an echo, which decodes) goes to a preparing
    thread; a bad token-id request is still a named 400."""
    import threading

    from vtcore.server.completions import CompletionsEndpoint

    threads: list[str] = []
    original = CompletionsEndpoint.prepare

    def spy(self: CompletionsEndpoint, body: Any) -> Any:
        threads.append(threading.current_thread().name)
        return original(self, body)

    monkeypatch.setattr(CompletionsEndpoint, "prepare", spy)
    url = server.url + "/v1/completions"
    for body in ({"prompt": [5, 6, 7]}, {"prompt": "Once upon a time"}, {"prompt": [[5, 6], [7, 8]]},
                 {"prompt": [5, 6, 7], "echo": True}):
        r = post_json(url, {"model": MODEL, "max_tokens": 2, **body})
        assert r.status_code == 200, r.text
    assert [name.startswith("vtcore-prepare") for name in threads] == [False, True, False, True]
    assert_400(post_json(url, {"model": MODEL, "max_tokens": 2000, "prompt": [5, 6, 7]}), "max_tokens")


def test_a_json_body_its_model_accepts_skips_fastapis_request_handler(server: ServerThread,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """The generation routes answer a JSON body their model accepts without FastAPI's dependency solving
    (``JSONBodyRoute.body_model``); a body the model refuses, another content type, and the other routes still
    go through FastAPI's handler and are answered as before."""
    import fastapi.routing
    import httpx

    solved: list[str] = []
    real = fastapi.routing.solve_dependencies

    async def counting(*args: Any, **kwargs: Any) -> Any:
        solved.append(kwargs["request"].url.path)
        return await real(*args, **kwargs)

    monkeypatch.setattr(fastapi.routing, "solve_dependencies", counting)
    url = server.url + "/v1/completions"
    r = post_json(url, {"model": MODEL, "prompt": [5, 6, 7], "max_tokens": 2, "temperature": 0})
    chat = post_json(server.url + "/v1/chat/completions", {"model": MODEL, "max_tokens": 2,
                                                            "messages": [{"role": "user", "content": "Hi"}]})
    assert r.status_code == 200 and chat.status_code == 200 and solved == [], (r.text, chat.text)
    assert r.json()["usage"]["prompt_tokens"] == 3 and r.json()["usage"]["completion_tokens"] == 2
    assert_400(post_json(url, {"model": MODEL, "prompt": [5, 6, 7], "max_tokens": "two"}), "max_tokens")
    assert solved == ["/v1/completions"]
    text = httpx.post(url, content=b'{"prompt": [5, 6, 7], "max_tokens": 2}', timeout=60,
                      headers={"content-type": "text/plain"})
    assert text.status_code == 400 and solved == ["/v1/completions"] * 2, text.text
    assert post_json(server.url + "/tokenize", {"prompt": "hi"}).status_code == 200
    assert solved[-1] == "/tokenize"


class _Body(BaseModel):  # (module level: the endpoints' annotations below are resolved from here)
    x: int


def test_only_a_marked_endpoint_of_body_and_request_takes_the_direct_path() -> None:
    """``JSONBodyRoute.body_model``: an endpoint marked ``direct_json`` whose parameters are the body and the
    request; no direct path without the mark, with another parameter FastAPI fills in (it would go unfilled), or
    with a dependency (it would go unsolved)."""
    from fastapi import Depends, FastAPI

    from vtcore.server.json_body import JSONBodyRoute, direct_json

    app = FastAPI()
    app.router.route_class = JSONBodyRoute

    @app.post("/marked")
    @direct_json
    async def marked(body: _Body, request: Request) -> Response:
        return Response()

    @app.post("/unmarked")
    async def unmarked(body: _Body, request: Request) -> Response:
        return Response()

    @app.post("/tasks")
    @direct_json
    async def tasks(body: _Body, request: Request, background: BackgroundTasks) -> Response:
        return Response()

    @app.post("/dependency", dependencies=[Depends(lambda: None)])
    @direct_json
    async def dependency(body: _Body, request: Request) -> Response:
        return Response()

    models = {r.path: r.body_model for r in app.routes if isinstance(r, JSONBodyRoute)}
    assert models == {"/marked": _Body, "/unmarked": None, "/tasks": None, "/dependency": None}


def test_bodies_are_parsed_by_orjson_and_what_it_refuses_by_json(server: ServerThread,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """Every route reads its JSON body through orjson (``JSONBodyRoute``); a body orjson refuses (NaN here) goes
    to ``json``, and is answered as before (the non-finite logit_bias test above holds it to that)."""
    import orjson

    from vtcore.server import json_body

    parsed: list[bytes] = []

    class Counting:
        JSONDecodeError = orjson.JSONDecodeError

        @staticmethod
        def loads(body: bytes) -> Any:
            parsed.append(body)
            return orjson.loads(body)

    monkeypatch.setattr(json_body, "orjson", Counting)
    body = {"model": MODEL, "prompt": list(range(5, 905)), "max_tokens": 1}
    assert post_json(server.url + "/v1/completions", body).status_code == 200
    assert post_json(server.url + "/tokenize", {"prompt": "hi"}).status_code == 200
    assert len(parsed) == 2 and b'"max_tokens": 1' in parsed[0]
    r = post_json(server.url + "/v1/completions", {**body, "logit_bias": {"35": float("nan")}})
    assert len(parsed) == 3 and assert_400(r, "logit_bias")


def test_an_unknown_field_is_served_and_named_in_the_log(server: ServerThread, client: Any,  # noqa: F811
                                                         server_log: Records) -> None:
    """(vLLM's warning: a misspelt sampling field would otherwise go without effect, unseen.)"""
    r = client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=2, extra_body={"temprature": 0.0})
    assert r.choices[0].finish_reason == "length"
    warned = [rec.getMessage() for rec in server_log.records if rec.levelno == logging.WARNING]
    assert "request fields ignored (not fields of this endpoint): temprature" in warned, warned
    # an extension the endpoints do read is not called ignored (every structured_outputs request once was)
    r = client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=3,
                                  extra_body={"structured_outputs": {"regex": "[XYZ]{3}"}})
    assert len(r.choices[0].text) == 3 and set(r.choices[0].text) <= set("XYZ"), r.choices[0].text
    warned = [rec.getMessage() for rec in server_log.records if rec.levelno == logging.WARNING]
    assert not any("structured_outputs" in w for w in warned), warned
