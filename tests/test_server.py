"""The OpenAI-compatible server, through the real ``openai`` client, on a loopback port in-process.

One engine (the embedded default model on CPU) serves a module-scoped uvicorn server in a background
thread; a second server over the same engine has an API key (fixtures in ``server_harness``). Every
socket is 127.0.0.1. The offline ``LLM`` over the same checkpoint is the reference for the greedy
outputs.
"""
from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from typing import Any, Iterator

import pytest
from server_harness import (API_KEY, HOST, MAX_BYTES, MODEL, PROMPTS, REPO_ROOT, ServerThread, client,  # noqa: F401
                            engine, error_of, greedy, httpx, keyed_server, metric, needs_default_model, offline,
                            openai, serve_in_thread, server, wait_pool_empty)

from vtcore import LLM, AsyncLLM, SamplingParams
from vtcore.server.serve import listening_socket

pytestmark = needs_default_model


# --------------------------------------------------------------------------------------------- basics
def test_models_health_and_version(server: ServerThread, client: Any) -> None:
    models = client.models.list()
    assert [m.id for m in models.data] == [MODEL]
    assert httpx.get(server.url + "/health").status_code == 200
    for ping in (httpx.get, httpx.post):  # vLLM's SageMaker probe
        assert ping(server.url + "/ping").json() == {"status": "ok"}
    refused = httpx.put(server.url + "/ping")  # a 405 names every method of the path (two routes here)
    assert refused.status_code == 405 and refused.headers["allow"] == "GET, POST"
    assert httpx.get(server.url + "/v1/models/" + MODEL).json()["id"] == MODEL
    r = httpx.get(server.url + "/v1/nowhere")
    assert r.status_code == 404 and r.json()["error"]["type"] == "invalid_request_error"


def test_completion_matches_offline(client: Any, offline: LLM) -> None:
    ref = offline.generate(PROMPTS[0], greedy(12))[0].outputs[0]
    r = client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=12, temperature=0)
    choice = r.choices[0]
    assert r.object == "text_completion" and r.model == MODEL
    assert choice.text == ref.text and choice.finish_reason == ref.finish_reason
    n_prompt = len(offline.get_tokenizer().encode(PROMPTS[0], add_special_tokens=False))
    assert r.usage.prompt_tokens == n_prompt
    assert r.usage.completion_tokens == len(ref.token_ids)
    assert r.usage.total_tokens == n_prompt + len(ref.token_ids)


def test_prompt_batches_and_token_ids_give_one_choice_each(client: Any, offline: LLM) -> None:
    refs = [o.outputs[0].text for o in offline.generate(PROMPTS, greedy(8, ignore_eos=True))]
    r = client.completions.create(model=MODEL, prompt=PROMPTS, max_tokens=8, temperature=0,
                                  extra_body={"ignore_eos": True})
    assert [c.index for c in r.choices] == list(range(len(PROMPTS)))
    assert [c.text for c in r.choices] == refs
    assert r.usage.completion_tokens == 8 * len(PROMPTS)
    ids = [offline.get_tokenizer().encode(p, add_special_tokens=False) for p in PROMPTS[:2]]
    one = client.completions.create(model=MODEL, prompt=ids[0], max_tokens=8, temperature=0,
                                    extra_body={"ignore_eos": True})
    assert [c.text for c in one.choices] == refs[:1]
    two = client.completions.create(model=MODEL, prompt=ids, max_tokens=8, temperature=0,
                                    extra_body={"ignore_eos": True})
    assert [c.text for c in two.choices] == refs[:2]


def test_chat_matches_offline(client: Any, offline: LLM) -> None:
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Tell me something wise."}]
    ref = offline.chat(messages, greedy(20))[0]
    r = client.chat.completions.create(model=MODEL, messages=messages, max_completion_tokens=20, temperature=0)
    assert r.object == "chat.completion"
    msg = r.choices[0].message
    assert msg.role == "assistant" and msg.content == ref.outputs[0].text
    assert r.choices[0].finish_reason == ref.outputs[0].finish_reason
    assert r.usage.prompt_tokens == len(ref.prompt_token_ids)
    assert r.usage.completion_tokens == len(ref.outputs[0].token_ids)
    parts = [{"role": "user", "content": [{"type": "text", "text": "Tell me something wise."}]}]
    r2 = client.chat.completions.create(model=MODEL, messages=parts, max_tokens=20, temperature=0)
    plain = [{"role": "user", "content": "Tell me something wise."}]
    assert r2.choices[0].message.content == offline.chat(plain, greedy(20))[0].outputs[0].text


def test_streaming_equals_non_streaming(client: Any) -> None:
    kw = dict(model=MODEL, max_tokens=40, temperature=0, extra_body={"ignore_eos": True})
    full = client.completions.create(prompt=PROMPTS[2], **kw)
    chunks = list(client.completions.create(prompt=PROMPTS[2], stream=True,
                                            stream_options={"include_usage": True}, **kw))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == full.choices[0].text and len(chunks) > 5
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 40
    assert chunks[-1].usage.prompt_tokens == full.usage.prompt_tokens

    messages = [{"role": "user", "content": "Once upon a time"}]
    full = client.chat.completions.create(messages=messages, **kw)
    chunks = list(client.chat.completions.create(messages=messages, stream=True, **kw))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks)
    assert text == full.choices[0].message.content
    assert chunks[-1].choices[0].finish_reason == "length" and chunks[-1].usage is None


def test_n_choices_are_the_engines_n_samples(client: Any, offline: LLM) -> None:
    """``n``: n choices a prompt (index prompt * n + sample), sample j the engine's n > 1 sample j
    (seed + j); a prompt's tokens count once in usage; streamed choices add up to the same; chat too."""
    kw = dict(model=MODEL, max_tokens=6, temperature=1.0, seed=5, n=3, extra_body={"ignore_eos": True})
    params = SamplingParams(temperature=1.0, max_tokens=6, seed=5, n=3, ignore_eos=True)
    refs = [[c.text for c in o.outputs] for o in offline.generate(PROMPTS[:2], params)]
    r = client.completions.create(prompt=PROMPTS[:2], **kw)
    assert [c.index for c in r.choices] == list(range(6))
    assert [c.text for c in r.choices] == refs[0] + refs[1] and len(set(refs[0])) > 1
    n_prompt = sum(len(offline.get_tokenizer().encode(p, add_special_tokens=False)) for p in PROMPTS[:2])
    assert r.usage.prompt_tokens == n_prompt and r.usage.completion_tokens == 6 * 6
    texts = ["", "", ""]
    for chunk in client.completions.create(prompt=PROMPTS[0], stream=True, **kw):
        for c in chunk.choices:
            texts[c.index] += c.text
    assert texts == refs[0]
    messages = [{"role": "user", "content": "Once upon a time"}]
    want = [c.text for c in offline.chat(messages, params)[0].outputs]
    r = client.chat.completions.create(messages=messages, **kw)
    assert [(c.index, c.message.content) for c in r.choices] == list(enumerate(want))
    texts, roles = ["", "", ""], []
    for chunk in client.chat.completions.create(messages=messages, stream=True, **kw):
        for c in chunk.choices:
            texts[c.index] += c.delta.content or ""
            roles += [c.index] if c.delta.role == "assistant" else []
    assert texts == want and sorted(roles) == [0, 1, 2]


def test_raw_sse_framing(server: ServerThread) -> None:
    body = {"model": MODEL, "prompt": PROMPTS[1], "max_tokens": 4, "stream": True, "temperature": 0}
    with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=30) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        raw = r.read().decode()
    events = raw.split("\n\n")
    assert events[-1] == "" and events[-2] == "data: [DONE]"
    assert all(e.startswith("data: {") for e in events[:-2])
    assert all(json.loads(e[6:])["object"] == "text_completion" for e in events[:-2])


def test_sse_events_are_compact_utf8_json_even_where_orjson_refuses() -> None:
    from vtcore.server.sse import sse

    assert sse({"text": "é ✓", "logprobs": None, "ids": [1, 2]}) == (
        'data: {"text":"é ✓","logprobs":null,"ids":[1,2]}\n\n'.encode())
    for odd in ({"text": "a\ud800b"}, {"seed": 2**70}):  # a lone surrogate (escaped), an integer past 64 bits
        event = sse(odd)
        assert event.startswith(b"data: ") and event.endswith(b"\n\n") and json.loads(event[6:]) == odd


def test_sampling_fields(client: Any, offline: LLM) -> None:
    kw = dict(model=MODEL, prompt=PROMPTS[0], max_tokens=16)
    a = client.completions.create(temperature=0.9, top_p=0.9, seed=7, **kw).choices[0].text
    b = client.completions.create(temperature=0.9, top_p=0.9, seed=7, **kw).choices[0].text
    assert a == b
    ref = offline.generate(PROMPTS[0], SamplingParams(temperature=0.9, top_p=0.9, seed=7, max_tokens=16))
    assert a == ref[0].outputs[0].text
    full = client.completions.create(temperature=0, **kw).choices[0].text
    stop = full.strip().split(" ")[1]
    r = client.completions.create(temperature=0, stop=[stop, "zzzz"], **kw).choices[0]
    assert r.text == full[:full.index(stop)] and r.finish_reason == "stop"
    r = client.completions.create(temperature=0, stop=stop, **kw).choices[0]
    assert r.text == full[:full.index(stop)]
    chunks = list(client.completions.create(temperature=0, stop=stop, stream=True, **kw))
    assert "".join(c.choices[0].text for c in chunks) == r.text and chunks[-1].choices[0].finish_reason == "stop"
    forced = client.completions.create(temperature=0, logit_bias={"35": 100}, logprobs=0, **kw).choices[0]
    assert set(forced.logprobs.tokens) == {offline.get_tokenizer().decode([35])}
    extras = {"top_k": 5, "min_p": 0.05, "min_tokens": 3, "ignore_eos": True, "repetition_penalty": 1.1}
    r = client.completions.create(temperature=0.7, seed=1, presence_penalty=0.5, frequency_penalty=0.5,
                                  extra_body=extras, **kw)
    ref = offline.generate(PROMPTS[0], SamplingParams(temperature=0.7, seed=1, presence_penalty=0.5,
                                                      frequency_penalty=0.5, max_tokens=16, **extras))
    assert r.choices[0].text == ref[0].outputs[0].text and r.usage.completion_tokens == 16


def test_completion_and_chat_logprobs(client: Any, offline: LLM) -> None:
    ref = offline.generate(PROMPTS[1], greedy(6, logprobs=2, ignore_eos=True))[0].outputs[0]
    r = client.completions.create(model=MODEL, prompt=PROMPTS[1], max_tokens=6, temperature=0, logprobs=2,
                                  extra_body={"ignore_eos": True})
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 6
    assert "".join(lp.tokens) == r.choices[0].text
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(6)]
    for i, (tid, pos) in enumerate(zip(ref.token_ids, ref.logprobs)):
        assert lp.token_logprobs[i] == pytest.approx(pos[tid].logprob, abs=1e-4)
        assert 2 <= len(lp.top_logprobs[i]) <= 3 and max(lp.top_logprobs[i].values()) == pytest.approx(
            lp.token_logprobs[i], abs=1e-4)  # greedy: the chosen token is the top one
    chunks = list(client.completions.create(model=MODEL, prompt=PROMPTS[1], max_tokens=6, temperature=0,
                                            logprobs=2, stream=True, extra_body={"ignore_eos": True}))
    assert [t for c in chunks for t in (c.choices[0].logprobs.tokens if c.choices[0].logprobs else [])] == lp.tokens

    messages = [{"role": "user", "content": "hi"}]
    c = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=5, temperature=0, logprobs=True,
                                       top_logprobs=3, extra_body={"ignore_eos": True})
    content = c.choices[0].logprobs.content
    assert len(content) == 5 and "".join(t.token for t in content) == c.choices[0].message.content
    for t in content:
        assert len(t.top_logprobs) == 3 and t.top_logprobs[0].token == t.token
        assert t.top_logprobs[0].logprob == pytest.approx(t.logprob) and t.bytes == list(t.token.encode())
    assert client.chat.completions.create(model=MODEL, messages=messages, max_tokens=3).choices[0].logprobs is None
    # past OpenAI's limits (5 and 20), up to the server's max_logprobs (vLLM's default 20) as in vLLM
    wide = client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=2, temperature=0, logprobs=20)
    assert [len(top) for top in wide.choices[0].logprobs.top_logprobs] == [20, 20]


def test_echo_logprobs_max_tokens_zero(client: Any, offline: LLM) -> None:
    """What evaluation harnesses send to score a text: its prompt logprobs and no generation."""
    text = "The capital of France is Paris."
    ref = offline.generate(text, SamplingParams(prompt_logprobs=1, max_tokens=0))[0]
    r = client.completions.create(model=MODEL, prompt=text, max_tokens=0, echo=True, logprobs=1, temperature=0)
    choice = r.choices[0]
    assert choice.text == text and choice.finish_reason == "length"
    lp = choice.logprobs
    n = len(ref.prompt_token_ids)
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == n and "".join(lp.tokens) == text
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    for i in range(1, n):
        tid = ref.prompt_token_ids[i]
        assert lp.token_logprobs[i] == pytest.approx(ref.prompt_logprobs[i][tid].logprob, abs=1e-4)
        assert 1 <= len(lp.top_logprobs[i]) <= 2
    assert r.usage.prompt_tokens == n and r.usage.completion_tokens == 0
    # a batch of token-id prompts, and echo with generation after the prompt
    ids = ref.prompt_token_ids
    r = client.completions.create(model=MODEL, prompt=[ids, ids[:4]], max_tokens=0, echo=True, logprobs=0)
    assert [len(c.logprobs.tokens) for c in r.choices] == [n, 4]
    assert r.choices[1].logprobs.token_logprobs[1:] == pytest.approx(lp.token_logprobs[1:4], abs=1e-4)
    r = client.completions.create(model=MODEL, prompt=text, max_tokens=3, echo=True, logprobs=1, temperature=0,
                                  extra_body={"ignore_eos": True})
    assert r.choices[0].text.startswith(text) and len(r.choices[0].logprobs.tokens) == n + 3
    chunks = list(client.completions.create(model=MODEL, prompt=text, max_tokens=3, echo=True, logprobs=1,
                                            temperature=0, stream=True, extra_body={"ignore_eos": True}))
    assert "".join(c.choices[0].text for c in chunks) == r.choices[0].text
    assert [t for c in chunks for t in c.choices[0].logprobs.tokens] == r.choices[0].logprobs.tokens


def test_echo_logprobs_of_long_prompts_arriving_together(client: Any, offline: LLM, engine: AsyncLLM) -> None:
    """Three 900-token prompts overflow one step's token budget (2048), so one prefill is chunked: a
    max_tokens=0 + prompt_logprobs request still gets every chunk's logprobs (it once drained after
    the first)."""
    assert engine.limits().max_num_batched_tokens < 3 * 900
    prompts = [[(7 * i + j) % 2000 + 10 for j in range(900)] for i in range(3)]
    r = client.with_options(timeout=30).completions.create(model=MODEL, prompt=prompts, max_tokens=0, echo=True,
                                                           logprobs=1)
    ref = offline.generate([{"prompt_token_ids": p} for p in prompts], SamplingParams(prompt_logprobs=1,
                                                                                      max_tokens=1))
    for choice, out in zip(r.choices, ref):
        assert choice.finish_reason == "length" and len(choice.logprobs.tokens) == 900
        want = [None] + [pos[t].logprob for pos, t in zip(out.prompt_logprobs[1:], out.prompt_token_ids[1:])]
        assert choice.logprobs.token_logprobs[0] is None
        assert choice.logprobs.token_logprobs[1:] == pytest.approx(want[1:], abs=1e-3)
    assert r.usage.completion_tokens == 0 and r.usage.prompt_tokens == 2700
    chunks = list(client.with_options(timeout=30).completions.create(
        model=MODEL, prompt=prompts, max_tokens=0, echo=True, logprobs=0, stream=True))
    assert sorted(len(c.choices[0].logprobs.tokens) for c in chunks if c.choices[0].logprobs) == [900] * 3
    wait_pool_empty(engine)


# --------------------------------------------------------------------------------------------- errors
@pytest.mark.parametrize("field, kwargs", [
    ("temperature", dict(temperature=-1)),
    ("top_p", dict(top_p=1.5)),
    ("n", dict(n=0)),
    ("best_of", dict(best_of=3)),
    ("logprobs", dict(logprobs=21)),  # past vLLM's max_logprobs
    ("logprobs", dict(logprobs=-1)),  # vLLM's completions take no -1
    ("max_tokens", dict(max_tokens=-1)),
    ("presence_penalty", dict(presence_penalty=5)),
    ("logit_bias", dict(logit_bias={"abc": 1})),
    ("logit_bias", dict(logit_bias={"999999": 1})),
    ("stop", dict(stop=[""])),
    ("seed", dict(seed="x")),  # FastAPI's 422, answered as a 400
    ("temperature", dict(temperature="hot")),
    ("prompt", dict(prompt=[1, "a"])),
    ("prompt", dict(prompt=[])),
    ("prompt", dict(prompt=[[5, 999999]])),
    ("suffix", dict(suffix="tail")),
    ("top_k", dict(extra_body={"top_k": -5})),
    ("min_tokens", dict(extra_body={"min_tokens": 50})),
    ("use_beam_search", dict(extra_body={"use_beam_search": True})),
    # vLLM extensions not implemented here: refused, not answered with unconstrained text
    ("guided_choice", dict(extra_body={"guided_choice": ["yes", "no"]})),
    ("structured_outputs", dict(extra_body={"structured_outputs": {"choice": "yes"}})),  # not a list
    ("allowed_token_ids", dict(extra_body={"allowed_token_ids": [10 ** 9]})),  # past the vocabulary
    ("bad_words", dict(extra_body={"bad_words": [""]})),
    ("length_penalty", dict(extra_body={"length_penalty": 2.0})),
    ("prompt_logprobs", dict(extra_body={"prompt_logprobs": 21})),  # past vLLM's max_logprobs
    ("prompt_logprobs", dict(extra_body={"prompt_logprobs": -1})),
    ("truncate_prompt_tokens", dict(extra_body={"truncate_prompt_tokens": -2})),
    ("response_format", dict(extra_body={"response_format": {"type": "xml"}})),
    ("stream_options", dict(stream_options={"include_usage": True})),  # without stream=true
    ("response_format.json_schema.schema", dict(extra_body={"response_format": {"type": "json_schema",
                                                                                "json_schema": {"name": "x"}}})),
])
def test_bad_completion_field_is_400_naming_it(client: Any, field: str, kwargs: dict[str, Any]) -> None:
    args = dict(model=MODEL, prompt=PROMPTS[0], max_tokens=8)
    args.update(kwargs)
    with pytest.raises(openai.BadRequestError) as exc:
        client.completions.create(**args)
    err = error_of(exc.value)
    assert exc.value.status_code == 400 and err["type"] == "invalid_request_error"
    assert err["param"] == field, err
    assert field in err["message"] or field == "prompt", err


@pytest.mark.parametrize("path, field", [("/v1/completions", "temperature"), ("/v1/chat/completions", "temperature"),
                                         ("/v1/responses", "temperature"), ("/v1/completions", "repetition_penalty")])
def test_an_infinite_float_is_400_naming_its_field(server: ServerThread, path: str, field: str) -> None:
    # Python's json reads Infinity (the openai client refuses to send it); an event would write it as null
    prompt = {"/v1/completions": '"prompt": "hi"', "/v1/chat/completions": '"messages": [{"role": "user", '
              '"content": "hi"}]', "/v1/responses": '"input": "hi"'}[path]
    body = f'{{"model": "{MODEL}", {prompt}, "max_tokens": 4, "stream": true, "{field}": Infinity}}'
    r = httpx.post(server.url + path, content=body, headers={"content-type": "application/json"}, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == field, r.text


@pytest.mark.parametrize("body, reason", [
    (b'{"prompt": "hi", "max_tokens": 4', "Expecting ',' delimiter at character 32"),  # truncated
    (b'{"prompt": "\xff\xfe", "max_tokens": 4}', "not UTF-8 text (invalid start byte at byte 12)"),
    (b'{"prompt": ' + b"[" * 3000 + b"]" * 3000 + b"}", "nested deeper than the parser's limit"),
    (b'{"prompt": "hi", "max_tokens": 1' + b"0" * 5000 + b"}", "Exceeds the limit (4300 digits)"),
])
def test_a_body_that_is_not_json_is_400_saying_why(server: ServerThread, body: bytes, reason: str) -> None:
    """(Bytes that are not UTF-8, nesting past the parser's depth and a 5,000-digit integer were each answered
    "There was an error parsing the body".)"""
    r = httpx.post(server.url + "/v1/completions", content=body, headers={"content-type": "application/json"},
                   timeout=30)
    assert r.status_code == 400, r.text
    message = r.json()["error"]["message"]
    assert message.startswith("the request body is not valid JSON: " + reason), message


@pytest.mark.parametrize("field, kwargs", [
    ("n", dict(n=0)),
    ("top_logprobs", dict(top_logprobs=2)),  # without logprobs=true
    ("top_logprobs", dict(logprobs=True, top_logprobs=21)),
    ("max_completion_tokens", dict(max_completion_tokens=-2)),
    ("functions", dict(functions=[{"name": "f", "parameters": {}}])),
    ("tool_choice", dict(tools=[{"type": "function", "function": {"name": "f", "parameters": {}}}],
                         tool_choice={"type": "function", "function": {"name": "g"}})),
    ("tool_choice", dict(tool_choice="required")),
    ("response_format", dict(response_format={"type": "xml"})),
    ("stream_options", dict(stream=False, stream_options={"include_usage": True})),
    ("messages", dict(messages=[{"role": "user"}, {"content": "no role"}])),
    ("messages", dict(messages=[])),
    ("messages", dict(messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}])),
    ("frequency_penalty", dict(frequency_penalty=-3)),
    ("continue_final_message", dict(extra_body={"continue_final_message": True})),
    ("echo", dict(extra_body={"echo": True})),
    ("chat_template_kwargs", dict(extra_body={"chat_template_kwargs": {"chat_template": "{{ 'x' }}"}})),
])
def test_bad_chat_field_is_400_naming_it(client: Any, field: str, kwargs: dict[str, Any]) -> None:
    args: dict[str, Any] = dict(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=4)
    args.update(kwargs)
    with pytest.raises(openai.BadRequestError) as exc:
        client.chat.completions.create(**args)
    err = error_of(exc.value)
    assert err["param"] == field and err["type"] == "invalid_request_error", err
    if field == "max_completion_tokens":  # named as sent (it once read "SamplingParams.max_tokens=-2")
        assert err["message"].startswith("max_completion_tokens: ") and "(got -2)" in err["message"], err


def test_unknown_model_is_404(client: Any) -> None:
    with pytest.raises(openai.NotFoundError) as exc:
        client.completions.create(model="gpt-nope", prompt="hi", max_tokens=2)
    err = error_of(exc.value)
    assert exc.value.status_code == 404 and err["param"] == "model" and "gpt-nope" in err["message"]
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="gpt-nope", messages=[{"role": "user", "content": "hi"}], stream=True)


def test_too_long_prompt_is_400_naming_both_lengths(client: Any, engine: AsyncLLM) -> None:
    limit = engine.limits().max_model_len
    with pytest.raises(openai.BadRequestError) as exc:
        client.completions.create(model=MODEL, prompt=[5] * (limit + 76), max_tokens=4)
    err = error_of(exc.value)
    assert str(limit) in err["message"] and str(limit + 76) in err["message"] and err["param"] == "prompt"
    assert "tokens are in the prompt, which" in err["message"], err
    with pytest.raises(openai.BadRequestError) as exc:  # a list of prompts: the message names the one too long
        client.completions.create(model=MODEL, prompt=[[5, 6], [5] * (limit + 76)], max_tokens=4)
    err = error_of(exc.value)
    assert f"{limit + 76} tokens are in the prompt[1], which" in err["message"] and err["param"] == "prompt", err
    with pytest.raises(openai.BadRequestError) as exc:
        client.completions.create(model=MODEL, prompt=[5] * (limit - 10), max_tokens=100)
    err = error_of(exc.value)
    assert str(limit) in err["message"] and str(limit + 90) in err["message"] and err["param"] == "max_tokens"
    with pytest.raises(openai.BadRequestError) as exc:  # streaming: still a plain 400 before any event
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "word " * 2000}],
                                       stream=True)
    assert str(limit) in error_of(exc.value)["message"]
    wait_pool_empty(engine)


def test_bad_requests_fail_alone(client: Any, server: ServerThread, engine: AsyncLLM) -> None:
    async def main() -> tuple[str, list[Any]]:
        async with openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0, timeout=60) as ac:
            good = ac.completions.create(model=MODEL, prompt=PROMPTS[3], max_tokens=30, temperature=0,
                                         extra_body={"ignore_eos": True})
            bad = [ac.completions.create(model=MODEL, prompt=PROMPTS[3], max_tokens=4, temperature=t)
                   for t in (-1, -2, -3)]
            bad.append(ac.completions.create(model=MODEL, prompt=[5] * 5000, max_tokens=4))
            results = await asyncio.gather(good, *bad, return_exceptions=True)
            return results[0].choices[0].text, results[1:]

    text, errors = asyncio.run(main())
    assert all(isinstance(e, openai.BadRequestError) for e in errors)
    ref = client.completions.create(model=MODEL, prompt=PROMPTS[3], max_tokens=30, temperature=0,
                                    extra_body={"ignore_eos": True})
    assert text == ref.choices[0].text
    assert httpx.get(server.url + "/health").status_code == 200
    wait_pool_empty(engine)


def test_api_key(keyed_server: ServerThread) -> None:
    url = keyed_server.url + "/v1"
    with openai.OpenAI(base_url=url, api_key="wrong", max_retries=0) as c:
        with pytest.raises(openai.AuthenticationError) as exc:
            c.completions.create(model=MODEL, prompt="hi", max_tokens=1)
        assert exc.value.status_code == 401 and error_of(exc.value)["code"] == "invalid_api_key"
    for headers in ({}, {"authorization": "Basic " + API_KEY}, {"authorization": "Bearer"}):
        r = httpx.post(url + "/completions", json={"model": MODEL, "prompt": "hi", "max_tokens": 1}, headers=headers)
        assert r.status_code == 401 and r.json()["error"]["type"] == "invalid_request_error"
        assert r.headers["www-authenticate"] == "Bearer"
    with openai.OpenAI(base_url=url, api_key=API_KEY, max_retries=0) as c:
        assert c.completions.create(model=MODEL, prompt="hi", max_tokens=2).usage.completion_tokens <= 2
        assert [m.id for m in c.models.list().data] == [MODEL]
    for probe in ("/health", "/ping"):  # probes need no key
        assert httpx.get(keyed_server.url + probe).status_code == 200


def test_request_too_large_is_413(client: Any, server: ServerThread) -> None:
    with pytest.raises(openai.APIStatusError) as exc:
        client.completions.create(model=MODEL, prompt="x" * (MAX_BYTES + 10), max_tokens=1)
    assert exc.value.status_code == 413 and error_of(exc.value)["type"] == "invalid_request_error"

    def chunked() -> Iterator[bytes]:  # no Content-Length: the limit is counted while reading
        yield b'{"model": "' + MODEL.encode() + b'", "prompt": "'
        for _ in range(8):
            yield b"y" * (MAX_BYTES // 4)
        yield b'"}'

    r = httpx.post(server.url + "/v1/completions", content=chunked(), headers={"content-type": "application/json"})
    assert r.status_code == 413 and "limit" in r.json()["error"]["message"]
    assert client.completions.create(model=MODEL, prompt="still serving", max_tokens=2).choices


# ------------------------------------------------------------------------------------------ lifecycle
def test_disconnect_mid_stream_aborts_and_frees_blocks(client: Any, server: ServerThread,
                                                       engine: AsyncLLM) -> None:
    wait_pool_empty(engine)
    before = metric(httpx.get(server.url + "/metrics").text, "vtcore:request_success_total", finished_reason="abort")
    stream = client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=900, temperature=0, stream=True,
                                       extra_body={"ignore_eos": True})
    got = 0
    for _ in stream:
        got += 1
        if got == 3:
            break
    assert engine.stats().kv_cache_usage > 0  # it holds blocks while it runs
    stream.close()
    wait_pool_empty(engine)
    # a non-streaming request whose client gives up is aborted too
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(server.url + "/v1/chat/completions", timeout=httpx.Timeout(10, read=0.5),
                   json={"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 900,
                         "ignore_eos": True})
    wait_pool_empty(engine)
    after = metric(httpx.get(server.url + "/metrics").text, "vtcore:request_success_total", finished_reason="abort")
    assert after - before == 2


def test_64_concurrent_streams_match_offline(server: ServerThread, offline: LLM, engine: AsyncLLM) -> None:
    n, max_tokens = 64, 24
    prompts = [f"{PROMPTS[i % 4]} {w}" for i, w in enumerate(("number " + str(i) for i in range(n)))]
    ref = offline.generate(prompts, greedy(max_tokens, ignore_eos=True))
    expected = [o.outputs[0].text for o in ref]

    async def one(ac: Any, i: int) -> tuple[str, int]:
        await asyncio.sleep(0.002 * (i % 7))  # staggered arrivals: batches differ from the offline run
        stream = await ac.completions.create(model=MODEL, prompt=prompts[i], max_tokens=max_tokens, temperature=0,
                                             stream=True, stream_options={"include_usage": True},
                                             extra_body={"ignore_eos": True})
        parts, usage = [], None
        async for chunk in stream:
            if chunk.choices:
                parts.append(chunk.choices[0].text)
            if chunk.usage:
                usage = chunk.usage.completion_tokens
        return "".join(parts), usage

    async def main() -> list[tuple[str, int]]:
        async with openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0, timeout=120) as ac:
            return await asyncio.gather(*(one(ac, i) for i in range(n)))

    got = asyncio.run(main())
    assert [u for _, u in got] == [max_tokens] * n
    # CPU float32 is not batch-invariant, so a near tie may flip under other batches; none is expected
    # with this model, and any would have to be rare.
    differ = [i for i in range(n) if got[i][0] != expected[i]]
    assert len(differ) <= 2, [(got[i][0], expected[i]) for i in differ]
    wait_pool_empty(engine)


def test_every_finish_reasons_series_is_there_from_the_start() -> None:
    """As vLLM's: a fresh server's /metrics has each finish reason's success counter at 0 (a rate() sees the
    first request of each)."""
    from vtcore.server.metrics import ServerMetrics

    body = ServerMetrics("m", lambda: None).render()
    for reason in ("stop", "length", "abort"):
        assert f'vtcore:request_success_total{{model_name="m",finished_reason="{reason}"}} 0.0' in body, body


def test_metrics_move(server: ServerThread, client: Any, engine: AsyncLLM) -> None:
    def scrape() -> str:
        r = httpx.get(server.url + "/metrics")
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
        return r.text

    before = scrape()
    for name in ("vtcore:kv_cache_usage_perc", "vtcore:time_to_first_token_seconds",
                 "vtcore:time_per_output_token_seconds", "vtcore:prompt_tokens_total"):
        assert f"# TYPE {name} " in before
    done = client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=5, temperature=0,
                                     extra_body={"ignore_eos": True})
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=5, temperature=-1)
    after = scrape()

    def delta(name: str, **labels: str) -> float:
        return metric(after, name, **labels) - metric(before, name, **labels)

    n_prompt = len(engine.tokenizer.encode(PROMPTS[0], add_special_tokens=False))
    assert delta("vtcore:request_success_total", finished_reason="length") == 1
    assert delta("vtcore:prompt_tokens_total") == n_prompt
    assert delta("vtcore:generation_tokens_total") == 5
    assert delta("vtcore:time_to_first_token_seconds_count") == 1
    assert delta("vtcore:request_time_per_output_token_seconds_count") == 1  # one mean a request
    # one sample an output after the first (outputs a busy loop has not taken merge: at most one a token)
    assert 1 <= delta("vtcore:inter_token_latency_seconds_count") <= 4
    assert delta("vtcore:time_per_output_token_seconds_count") == delta("vtcore:inter_token_latency_seconds_count")
    assert delta("vtcore:time_to_first_token_seconds_bucket", le="+Inf") == 1
    assert delta("vtcore:http_requests_total", endpoint="/v1/completions", status="200") == 1
    assert delta("vtcore:http_requests_total", endpoint="/v1/completions", status="400") == 1
    assert metric(after, "vtcore:kv_cache_usage_perc") == 0.0
    # (vLLM's iteration_tokens_total) the engine's steps by the tokens each computed: the prompt's uncached tokens in
    # one step, then the four tokens fed back one a step
    cached = done.usage.prompt_tokens_details.cached_tokens if done.usage.prompt_tokens_details else 0
    assert delta("vtcore:iteration_tokens_total_sum") == n_prompt - cached + 4
    assert delta("vtcore:iteration_tokens_total_count") == 5
    assert delta("vtcore:iteration_tokens_total_bucket", le="1.0") == 4
    assert delta("vtcore:iteration_tokens_total_bucket", le="+Inf") == 5
    # tokens count as they come (vLLM's counters move every step): mid-stream, the request's prompt and the
    # tokens streamed so far are in, its success is not
    stream = client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=40, temperature=0, stream=True,
                                       extra_body={"ignore_eos": True})
    chunks = iter(stream)
    for _ in range(3):
        next(chunks)
    mid = scrape()
    stream.close()
    assert metric(mid, "vtcore:prompt_tokens_total") - metric(after, "vtcore:prompt_tokens_total") == n_prompt
    assert 3 <= metric(mid, "vtcore:generation_tokens_total") - metric(after, "vtcore:generation_tokens_total") < 40
    assert metric(mid, "vtcore:request_success_total", finished_reason="length") == metric(
        after, "vtcore:request_success_total", finished_reason="length")


# ----------------------------------------------------------------------------------------- subprocess
def _free_port() -> int:
    with socket.socket() as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("stop", ["sigterm", "ctrl-c"])
def test_serve_subprocess_sigterm_exits_cleanly(stop: str) -> None:
    """SIGTERM to the server, or a terminal's Ctrl-C (SIGINT to its whole process group, the engine core process
    too): the same graceful shutdown."""
    port = _free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("VTCORE_")}
    proc = subprocess.Popen([sys.executable, "-m", "vtcore.server.serve", "--host", HOST, "--port", str(port),
                             "--device", "cpu", "--shutdown-timeout", "1", "--log-level", "warning"],
                            cwd=REPO_ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    try:
        url = f"http://{HOST}:{port}"
        deadline = time.monotonic() + 60
        while True:
            assert proc.poll() is None, proc.communicate()[0]
            try:
                if httpx.get(url + "/health", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, "the server did not come up"
            time.sleep(0.1)
        # a request not streamed, in flight at SIGTERM, is cut short too: a 503 (a 200 carrying finish_reason
        # "abort" read as an answer to a client that checks the status)
        whole = json.dumps({"model": "vtcore-default", "prompt": "Hi", "max_tokens": 1000, "ignore_eos": True})
        answered: list[httpx.Response] = []
        waiting = threading.Thread(target=lambda: answered.append(httpx.post(
            url + "/v1/completions", content=whole, headers={"content-type": "application/json"}, timeout=30)))
        waiting.start()
        # a stream in flight when SIGTERM arrives gets the grace period (1 s), then is aborted cleanly:
        # its last chunk says finish_reason "abort" and [DONE] follows
        with httpx.stream("POST", url + "/v1/completions", timeout=30,
                          json={"model": "vtcore-default", "prompt": "Hi", "max_tokens": 1000, "ignore_eos": True,
                                "stream": True}) as r:
            it = r.iter_lines()
            lines = [next(it)]
            assert lines[0].startswith("data: ")
            sent = time.monotonic()
            proc.send_signal(signal.SIGTERM) if stop == "sigterm" else os.killpg(proc.pid, signal.SIGINT)
            lines += [line for line in it if line]
        assert lines[-1] == "data: [DONE]"
        last = json.loads(lines[-2][len("data: "):])
        assert last["choices"][0]["finish_reason"] == "abort" and len(lines) < 1000
        waiting.join(timeout=30)
        (r,) = answered
        assert r.status_code == 503 and r.json()["error"]["code"] == "shutting_down", r.text
        assert "(1 of 1 completions cut short); send it again" in r.json()["error"]["message"], r.text
        out, _ = proc.communicate(timeout=15)
        assert proc.returncode == 0, out
        assert time.monotonic() - sent < 10
        assert "stopped" in out and "Traceback" not in out
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_serve_binds_before_loading_and_names_a_port_in_use(capsys: pytest.CaptureFixture) -> None:
    """A port in use is one error line, before the model loads (it once printed the URL, loaded the
    model, then failed in uvicorn); with --port 0 the URL names the port bound (it printed :0)."""
    from vtcore.server.serve import main as serve_main

    taken = listening_socket(HOST, 0)
    try:
        port = taken.getsockname()[1]
        started = time.monotonic()
        assert serve_main(["--host", HOST, "--port", str(port), "--device", "cpu"]) == 2
        assert capsys.readouterr().err == (f"vtcore serve: error: --host {HOST} --port {port}: cannot listen there "
                                           "(Address already in use)\n")
        assert time.monotonic() - started < 5  # no model was loaded
    finally:
        taken.close()
    any_port = listening_socket(HOST, 0)
    assert any_port.getsockname()[1] > 0
    any_port.close()


@pytest.mark.parametrize("core", [False, True], ids=["thread", "core-process"])
def test_serve_exits_1_when_its_engine_dies(monkeypatch, core: bool) -> None:
    """A dead engine loop (or engine core process) ends ``vtcore serve`` (exit 1, for a supervisor to
    restart it, as vLLM's server exits) instead of answering 500 engine_dead for ever."""
    import argparse

    from vtcore.engine import async_llm
    from vtcore.server.serve import add_serve_parser

    engines: list[AsyncLLM] = []

    class Recorded(AsyncLLM):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            engines.append(self)

    monkeypatch.setattr(async_llm, "AsyncLLM", Recorded)
    parser = argparse.ArgumentParser(prog="vtcore")
    add_serve_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["serve", "--host", HOST, "--port", "0", "--device", "cpu", "--log-level", "warning",
                              "--served-model-name", MODEL, "--shutdown-timeout", "0",
                              "--engine-core-process" if core else "--no-engine-core-process"])
    thread, result, url = serve_in_thread(args)

    def boom() -> None:
        raise RuntimeError("kaboom")

    if core:
        import os
        import signal

        os.kill(engines[0].engine.process.pid, signal.SIGKILL)
    else:
        engines[0].engine.step = boom
    r = httpx.post(url + "/v1/completions", json={"model": MODEL, "prompt": "Hi", "max_tokens": 2}, timeout=30)
    assert r.status_code == 500 and ("engine core process" if core else "kaboom") in r.text
    thread.join(30)
    assert not thread.is_alive() and result["rc"] == 1


def test_serve_parser_defaults_are_safe() -> None:
    import argparse
    import io

    from vtcore.server.serve import add_serve_parser, cmd_serve

    parser = argparse.ArgumentParser(prog="vtcore")
    add_serve_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["serve"])
    assert (args.host, args.port, args.api_key, args.func) == ("127.0.0.1", 8000, None, cmd_serve)
    assert "model" not in vars(args) and args.max_request_bytes > 0  # no MODEL: the embedded default
    args = parser.parse_args(["serve", "/m", "--served-model-name", "n", "--api-key", "k", "--device",
                              "cpu", "--max-request-bytes", "100", "--port", "9", "--host", "127.0.0.2"])
    assert (args.model, args.served_model_name, args.api_key, args.device, args.max_request_bytes, args.port,
            args.host) == ("/m", ["n"], "k", "cpu", 100, 9, "127.0.0.2")
    for bad in (["--port", "70000"], ["--max-request-bytes", "0"]):  # refused before the model loads
        with pytest.raises(ValueError, match=bad[0]):
            cmd_serve(parser.parse_args(["serve", *bad]), io.StringIO())


def test_served_model_names_are_aliases_each_answered_by_its_own_name(engine: AsyncLLM) -> None:
    """vLLM's ``--served-model-name a b``: every name is served and listed, a response carries the name its
    request used (the first where it named none), metrics the first; another name is a 404 naming them."""
    from vtcore.cli.main import build_parser
    from vtcore.server.app import build_app

    assert build_parser().parse_args(["serve", "--served-model-name", "a", "b"]).served_model_name == ["a", "b"]
    with ServerThread(build_app(engine, ["main-name", "alias"])) as srv:
        assert [m["id"] for m in httpx.get(srv.url + "/v1/models").json()["data"]] == ["main-name", "alias"]
        assert httpx.get(srv.url + "/v1/models/alias").json()["id"] == "alias"
        body = {"prompt": "a", "max_tokens": 2}
        assert httpx.post(srv.url + "/v1/completions", json={**body, "model": "alias"}).json()["model"] == "alias"
        assert httpx.post(srv.url + "/v1/completions", json=body).json()["model"] == "main-name"
        streamed = httpx.post(srv.url + "/v1/completions", json={**body, "model": "alias", "stream": True}).text
        assert '"model":"alias"' in streamed.replace(" ", "")
        err = httpx.post(srv.url + "/v1/completions", json={**body, "model": "other"})
        assert err.status_code == 404 and "serves 'main-name' or 'alias'" in err.json()["error"]["message"]
        assert 'model_name="main-name"' in httpx.get(srv.url + "/metrics").text


def test_tokenizing_a_prompt_does_not_stall_the_server(server: ServerThread, engine: AsyncLLM, monkeypatch) -> None:
    """Requests are tokenized off the event loop: while one prompt's tokenization is held (a 7 MB
    prompt took 7 s), the server still answers others (it once stalled every stream meanwhile)."""
    entered, release = threading.Event(), threading.Event()
    tokenize = engine.tokenize

    def held(prompt: Any, *args: Any) -> Any:
        if prompt == "HOLD":
            entered.set()
            release.wait(20)
        return tokenize(prompt, *args)

    monkeypatch.setattr(engine, "tokenize", held)
    slow: dict[str, Any] = {}
    worker = threading.Thread(target=lambda: slow.update(r=httpx.post(
        server.url + "/v1/completions", json={"model": MODEL, "prompt": "HOLD", "max_tokens": 2}, timeout=30)))
    worker.start()
    try:
        assert entered.wait(10)
        fast = httpx.post(server.url + "/v1/completions", json={"model": MODEL, "prompt": "Hi", "max_tokens": 2},
                          timeout=5)
        assert fast.status_code == 200 and not slow
    finally:
        release.set()
        worker.join(30)
    assert slow["r"].status_code == 200


def test_vllm_extensions_asking_for_nothing_and_chat_template_kwargs(client: Any, engine: AsyncLLM,
                                                                      monkeypatch) -> None:
    """An unsupported extension at its do-nothing value is fine (clients send the defaults), as are
    unknown fields; ``chat_template_kwargs`` reach the chat template (Qwen3's ``enable_thinking``)."""
    seen: list[dict] = []
    chat_prompt = engine.chat_prompt
    monkeypatch.setattr(engine, "chat_prompt", lambda m, **kw: (seen.append(kw), chat_prompt(m, **kw))[1])
    out = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=2,
        extra_body={"add_generation_prompt": True, "spaces_between_special_tokens": True, "echo": False,
                    "guided_json": None, "some_future_field": 1, "chat_template_kwargs": {"enable_thinking": False}})
    assert out.choices[0].finish_reason == "length" and seen == [{
        "enable_thinking": False, "chat_template": None, "add_generation_prompt": True,
        "continue_final_message": False}]


def test_generation_config_defaults_fill_unset_fields(engine: AsyncLLM, offline: LLM, monkeypatch) -> None:
    """Fields a request leaves out take the checkpoint's generation_config.json values (vLLM's
    default; read once, when the app is built); fields it sends win."""
    from vtcore.server.app import build_app

    monkeypatch.setattr(engine, "default_sampling", lambda: {"temperature": 0.0, "max_tokens": 3})
    want = offline.generate(PROMPTS[1], greedy(12))[0].outputs[0].text
    with ServerThread(build_app(engine, MODEL)) as srv:
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key="none")
        got = client.completions.create(model=MODEL, prompt=PROMPTS[1], max_tokens=12)  # no temperature: greedy
        assert got.choices[0].text == want and got.usage.completion_tokens > 3  # max_tokens stays the request's
        texts = {client.completions.create(model=MODEL, prompt=PROMPTS[1], max_tokens=12, temperature=1.0,
                                           seed=s).choices[0].text for s in range(4)}
    assert len(texts) > 1  # a temperature sent wins over the default


def test_prefix_cache_hits_show_in_usage_and_metrics(server: ServerThread, client: Any, engine: AsyncLLM) -> None:
    prompt = " ".join(f"item{i} of the prefix-cache list" for i in range(12))
    n_prompt = len(engine.tokenizer.encode(prompt, add_special_tokens=False))
    assert n_prompt > 2 * engine.engine.config.block_size
    before = httpx.get(server.url + "/metrics").text
    first = client.completions.create(model=MODEL, prompt=prompt, max_tokens=3, temperature=0)
    second = client.completions.create(model=MODEL, prompt=prompt, max_tokens=3, temperature=0,
                                       stream=True, stream_options={"include_usage": True})
    last = list(second)[-1]
    after = httpx.get(server.url + "/metrics").text
    bs = engine.engine.config.block_size
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    assert last.usage.prompt_tokens_details.cached_tokens == (n_prompt - 1) // bs * bs
    hits = metric(after, "vtcore:prefix_cache_hits_total") - metric(before, "vtcore:prefix_cache_hits_total")
    queries = metric(after, "vtcore:prefix_cache_queries_total") - metric(before, "vtcore:prefix_cache_queries_total")
    assert hits == (n_prompt - 1) // bs * bs and queries == 2 * n_prompt


def test_serve_runs_on_uvloop_and_httptools_when_installed() -> None:
    """vLLM's server runs on uvloop with httptools' parser; so does ``vtcore serve`` (both dependencies)."""
    uvloop = pytest.importorskip("uvloop")
    pytest.importorskip("httptools")
    import uvicorn

    from vtcore.server.serve import _event_loop_runner

    assert _event_loop_runner() is uvloop.run
    config = uvicorn.Config(lambda scope, receive, send: None, lifespan="off")
    config.load()
    assert config.http_protocol_class.__name__ == "HttpToolsProtocol"
