"""``/openapi.json`` is served and true: what it says of a request body, the server enforces (a body
the document's schema refuses gets a 400 naming the field, one it accepts is served), its errors are
400s (FastAPI documents 422s, which the server never answers) in OpenAI's error shape, and
``/metrics`` is text/plain."""
from __future__ import annotations

import re
from typing import Any

import pytest
from server_harness import MODEL, ServerThread, engine, httpx, needs_default_model, post_json, server  # noqa: F401

from vtcore import AsyncLLM
from vtcore.server.protocol import below_pattern

jsonschema = pytest.importorskip("jsonschema")
pytestmark = needs_default_model


@pytest.fixture(scope="module")
def doc(server: ServerThread) -> dict[str, Any]:
    r = httpx.get(server.url + "/openapi.json")
    assert r.status_code == 200 and r.headers["content-type"].startswith("application/json")
    return r.json()


def validator(doc: dict[str, Any], ref: str) -> Any:
    """A JSON Schema validator of the document's ``ref`` (its $refs resolved in the document)."""
    return jsonschema.Draft202012Validator({"$ref": ref, "components": doc["components"]})


def request_schema(doc: dict[str, Any], path: str) -> str:
    return doc["paths"][path]["post"]["requestBody"]["content"]["application/json"]["schema"]["$ref"]


def test_errors_are_documented_as_openai_shaped_400s(doc: dict[str, Any]) -> None:
    assert "HTTPValidationError" not in doc["components"]["schemas"]
    for path, operations in doc["paths"].items():
        for method, op in operations.items():
            assert "422" not in op["responses"], (method, path)
            for status, response in op["responses"].items():
                if status.startswith(("4", "5")):
                    schema = response["content"]["application/json"]["schema"]
                    assert schema == {"$ref": "#/components/schemas/ErrorResponse"}, (method, path, status)
    for path in ("/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize"):
        assert "400" in doc["paths"][path]["post"]["responses"], path
    error = validator(doc, "#/components/schemas/ErrorResponse")
    assert error.is_valid({"error": {"message": "m", "type": "invalid_request_error", "param": None, "code": None}})
    assert not error.is_valid({"detail": [{"loc": ["body", "n"], "msg": "bad"}]})  # FastAPI's shape


def test_metrics_are_documented_as_text(doc: dict[str, Any], server: ServerThread) -> None:
    assert list(doc["paths"]["/metrics"]["get"]["responses"]["200"]["content"]) == ["text/plain"]
    assert httpx.get(server.url + "/metrics").headers["content-type"].startswith("text/plain")
    streamed = doc["paths"]["/v1/completions"]["post"]["responses"]["200"]["content"]
    assert set(streamed) == {"application/json", "text/event-stream"}


def test_the_prompt_schema_has_this_engines_bounds(doc: dict[str, Any], engine: AsyncLLM) -> None:
    limits = engine.limits()
    prompt = doc["components"]["schemas"]["CompletionRequest"]["properties"]["prompt"]
    ids = [m for m in prompt["anyOf"] if m.get("items", {}).get("type") == "integer"]
    assert ids and all(m["items"]["minimum"] == 0 and m["items"]["exclusiveMaximum"] == limits.vocab_size
                       and m["minItems"] == 1 for m in ids)
    assert f"fewer than {limits.max_model_len} tokens" in prompt["description"]
    detokenize = doc["components"]["schemas"]["DetokenizeRequest"]["properties"]["tokens"]["items"]
    assert detokenize["exclusiveMaximum"] == limits.vocab_size


def test_integer_bounds_are_exact_integers(doc: dict[str, Any], server: ServerThread) -> None:
    """A 64-bit bound written as a float (9.223372036854776e+18) lets a client's float arithmetic take 2**63 +
    190 for a valid seed; the document writes it as the integer the server enforces."""
    seed = next(m for m in doc["components"]["schemas"]["CompletionRequest"]["properties"]["seed"]["anyOf"]
                if m.get("type") == "integer")
    assert seed["exclusiveMaximum"] == 2 ** 63 and isinstance(seed["exclusiveMaximum"], int)
    assert seed["minimum"] == -2 ** 63 and isinstance(seed["minimum"], int)
    completion = validator(doc, request_schema(doc, "/v1/completions"))
    for value, ok in ((2 ** 63 - 1, True), (2 ** 63 + 190, False)):
        assert completion.is_valid(_completion(seed=value)) is ok
        assert (post_json(server.url + "/v1/completions", _completion(seed=value)).status_code == 200) is ok


@pytest.mark.parametrize("n", [1, 2, 7, 10, 11, 100, 999, 1000, 1001, 2048, 151936])
def test_the_token_id_key_pattern_matches_exactly_the_ids_below_n(n: int) -> None:
    pattern = re.compile(below_pattern(n))
    for i in range(3 * n + 20):
        for zeros in ("", "0", "000"):
            assert bool(pattern.match(zeros + str(i))) == (i < n), (n, zeros + str(i))
    assert not any(pattern.match(k) for k in ("", "-1", "+1", " 1", "1 ", "1_0", "\u0665", "0x1"))


def _completion(**fields: Any) -> dict[str, Any]:
    return {"model": MODEL, "prompt": "Hi", "max_tokens": 1, **fields}


def _chat(**fields: Any) -> dict[str, Any]:
    return {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1, **fields}


TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}

#: (path, body, the field a refusal must name, or None where the document accepts the body)
BODIES = [
    ("/v1/completions", _completion(), None),
    ("/v1/completions", _completion(prompt=[5, 6]), None),
    ("/v1/completions", _completion(prompt=["a", "b"]), None),
    ("/v1/completions", _completion(prompt=[[5], [6, 7]]), None),
    ("/v1/completions", _completion(n=128), None),
    ("/v1/completions", _completion(logprobs=20), None),  # up to the server's max_logprobs (vLLM's 20)
    ("/v1/completions", _completion(prompt=""), "prompt"),
    ("/v1/completions", _completion(prompt=[]), "prompt"),
    ("/v1/completions", _completion(prompt=[-1]), "prompt"),
    ("/v1/completions", _completion(prompt="vocab"), "prompt"),  # [vocab_size], filled in below
    ("/v1/completions", _completion(prompt=[[5], []]), "prompt"),
    ("/v1/completions", _completion(prompt=["a", ""]), "prompt"),
    ("/v1/completions", _completion(prompt=[1, "a"]), "prompt"),
    ("/v1/completions", _completion(n=129), "n"),
    ("/v1/completions", _completion(n=0), "n"),
    ("/v1/completions", _completion(logprobs=21), "logprobs"),
    ("/v1/completions", _completion(truncate_prompt_tokens=5), None),
    ("/v1/chat/completions", _chat(truncate_prompt_tokens=10 ** 6), "truncate_prompt_tokens"),  # past max_model_len
    ("/v1/completions", _completion(logprobs=-1), "logprobs"),  # vLLM's completions take no -1
    ("/v1/chat/completions", _chat(logprobs=True, top_logprobs=21), "top_logprobs"),
    ("/v1/chat/completions", _chat(logprobs=True, top_logprobs=-1), "top_logprobs"),  # -1 past the cap of 20
    ("/v1/completions", _completion(logit_bias={"5": "big"}), "logit_bias"),
    ("/v1/completions", _completion(logit_bias={"0": 1, "0007": -1.5}), None),
    *[("/v1/completions", _completion(logit_bias={key: 1}), "logit_bias")
      for key in ("-1", "+5", " 5", "1_0", "\u0665", "", "99999999", "x-schemathesis-additional")],
    ("/v1/completions", _completion(stop=["a", ""]), "stop"),
    ("/v1/completions", _completion(bad_words=[" \t"]), "bad_words"),
    ("/v1/completions", _completion(bad_words=["\x1e"]), None),  # (Python's strip takes it; the pattern does not)
    ("/v1/completions", _completion(stop=""), "stop"),
    ("/v1/completions", _completion(stop=[]), None),
    ("/v1/chat/completions", _chat(logit_bias={"12": 3}), None),
    ("/v1/chat/completions", _chat(logit_bias={"1e3": 3}), "logit_bias"),
    ("/v1/chat/completions", _chat(logit_bias={"1" * 5001: 3}), "logit_bias"),  # (no huge int parsed)
    ("/v1/chat/completions", _chat(logit_bias={"0" * 30 + "12": 3}), None),
    ("/v1/completions", {"model": MODEL}, "prompt"),
    # strict bodies: JSON's types as the document gives them
    ("/v1/completions", _completion(max_tokens="5"), "max_tokens"),
    ("/v1/completions", _completion(logprobs=False), "logprobs"),
    ("/v1/completions", _completion(temperature="0.5"), "temperature"),
    ("/v1/completions", _completion(temperature=1), None),  # an integer is a number
    ("/v1/completions", _completion(max_tokens=5.0), None),  # and 5.0 an integer, as JSON Schema counts
    ("/v1/completions", _completion(max_tokens=5.5), "max_tokens"),
    ("/v1/completions", _completion(max_tokens=True), "max_tokens"),
    ("/v1/completions", _completion(max_tokens=10 ** 10), "max_tokens"),  # past any context
    ("/v1/chat/completions", _chat(max_completion_tokens=10 ** 10), "max_completion_tokens"),
    ("/v1/completions", _completion(seed=-2 ** 63), None),
    ("/v1/completions", _completion(seed=2 ** 63), "seed"),
    # vLLM's extensions this server refuses: only the value that asks for nothing (JSON's equality)
    ("/v1/completions", _completion(length_penalty=1), None),
    ("/v1/completions", _completion(length_penalty=2.0), "length_penalty"),
    ("/v1/completions", _completion(spaces_between_special_tokens=False), "spaces_between_special_tokens"),
    ("/v1/completions", _completion(return_tokens_as_token_ids=0), "return_tokens_as_token_ids"),  # a boolean
    ("/v1/chat/completions", _chat(echo=True), "echo"),
    ("/v1/chat/completions", _chat(add_special_tokens=True), "add_special_tokens"),  # the template's only
    ("/v1/chat/completions", _chat(add_special_tokens=False), None),
    ("/v1/chat/completions", _chat(priority=0.0), None),
    ("/v1/chat/completions", _chat(priority=2), "priority"),  # this server schedules first come, first served
    ("/v1/completions", _completion(seed=-2 ** 63 - 1), "seed"),  # orjson reads it as a float: not rounded in
    ("/v1/completions", _completion(seed=1e18), None),  # an integer, as JSON Schema counts, past 2**53 too
    ("/v1/completions", _completion(seed=1e19), "seed"),
    ("/v1/completions", _completion(top_k=4.676071553731185e+25), None),
    ("/v1/responses", {"model": MODEL, "input": "hi", "max_output_tokens": 2, "stop_token_ids": [7.0]}, None),
    ("/v1/responses", {"model": MODEL, "input": "hi", "stop_token_ids": [9.5e27]}, "stop_token_ids"),  # past the vocab
    # single-field ranges the sampling parameters check, in the document too
    ("/v1/completions", _completion(stop_token_ids=[-1]), "stop_token_ids"),
    ("/v1/completions", _completion(repetition_penalty=0.0), "repetition_penalty"),
    ("/v1/completions", _completion(top_p=0), "top_p"),
    ("/v1/completions", _completion(use_beam_search=True), "use_beam_search"),
    ("/v1/completions", _completion(best_of=2), "best_of"),
    ("/v1/completions", _completion(response_format={"type": "json_schema"}), "response_format.json_schema.schema"),
    ("/v1/completions", _completion(response_format={"type": "xml"}), "response_format"),
    ("/v1/chat/completions", _chat(), None),
    ("/v1/chat/completions", _chat(messages=[{"role": "user", "content": [{"type": "text", "text": "hi"}]}]), None),
    ("/v1/chat/completions", _chat(messages=[]), "messages"),
    ("/v1/chat/completions", _chat(messages=[{"role": "user"}]), "messages"),
    ("/v1/chat/completions", _chat(messages=[{"content": "hi"}]), "messages"),
    ("/v1/chat/completions", _chat(messages=[{"role": "assistant", "content": "", "tool_calls": [5]}]), "messages"),
    ("/v1/chat/completions", _chat(messages=[{"role": "assistant", "content": "", "tool_calls": [{}]}]), "messages"),
    ("/v1/chat/completions", _chat(logprobs=True, top_logprobs=21), "top_logprobs"),
    ("/v1/chat/completions", _chat(n=129), "n"),
    ("/v1/chat/completions", _chat(top_logprobs=2), "top_logprobs"),  # without logprobs=true
    ("/v1/chat/completions", _chat(logprobs=True, top_logprobs=2), None),
    ("/v1/chat/completions", _chat(tool_choice="required"), "tool_choice"),  # without tools
    ("/v1/chat/completions", _chat(tools=[TOOL], tool_choice="auto"), None),
    ("/v1/chat/completions", _chat(tools=[TOOL], tool_choice={"type": "function", "function": {"name": "f"}}), None),
    ("/v1/chat/completions", _chat(tools=[TOOL], tool_choice={"type": "function"}), "tool_choice"),
    ("/v1/chat/completions", _chat(tools=[TOOL], tool_choice="sometimes"), "tool_choice"),
    ("/v1/chat/completions", _chat(tools=[{"type": "function", "function": {"name": 5}}]), "tools"),
    ("/v1/chat/completions", _chat(tools=[{"type": "function", "function": {"name": "f", "parameters": []}}]),
     "tools"),
    ("/v1/chat/completions", _chat(function_call="auto"), "function_call"),
    ("/v1/chat/completions", _chat(messages=[{"role": "user", "content": [{"type": "image_url",
                                                                            "image_url": {"url": "x"}}]}]),
     "messages"),
    ("/v1/chat/completions", _chat(messages=[{"role": "user", "content": "hi"},
                                             {"role": "tool", "content": "x", "tool_call_id": 5}]), "messages"),
    ("/tokenize", {"prompt": "hi"}, None),
    ("/tokenize", {}, "prompt"),
    ("/tokenize", {"prompt": "hi", "messages": [{"role": "user", "content": "hi"}]}, "prompt"),
    ("/tokenize", {"prompt": "hi", "messages": [{"role": "user", "content": "hi"}], "tools": [TOOL]}, "prompt"),
    ("/tokenize", {"prompt": "hi", "add_special_tokens": True}, None),
    ("/tokenize", {"prompt": "hi", "add_special_tokens": 1}, "add_special_tokens"),
    ("/tokenize", {"messages": [{"role": "user", "content": "hi"}], "add_special_tokens": True}, "add_special_tokens"),
    ("/tokenize", {"messages": [{"role": "user", "content": "hi"}], "add_special_tokens": False}, None),
    ("/v1/completions", _completion(add_special_tokens=False), None),
    ("/v1/completions", _completion(add_special_tokens=0), "add_special_tokens"),
    ("/tokenize", {"prompt": "hi", "continue_final_message": 0}, "continue_final_message"),  # 0 is no false
    ("/tokenize", {"prompt": "hi", "add_generation_prompt": 1}, "add_generation_prompt"),
    ("/tokenize", {"prompt": "hi", "continue_final_message": True}, "continue_final_message"),
    ("/tokenize", {"prompt": "hi", "continue_final_message": True, "add_generation_prompt": False}, None),
    ("/tokenize", {"prompt": "hi", "tools": []}, "tools"),  # tools go with messages
    ("/tokenize", {"messages": [{"role": "user", "content": "hi"}], "tools": []}, None),
    ("/v1/chat/completions", _chat(continue_final_message=True), "continue_final_message"),
    ("/v1/chat/completions", _chat(prompt_logprobs=1), None),
    ("/v1/chat/completions", _chat(prompt_logprobs=1, stream=True), "prompt_logprobs"),
    ("/v1/completions", _completion(suffix="tail"), "suffix"),  # insertion is not served
    ("/v1/completions", _completion(suffix=""), None),
    ("/v1/completions", _completion(stream_options={"include_usage": True}), "stream_options"),  # not streamed
    ("/v1/completions", _completion(stream=True, stream_options={"include_usage": True}), None),
    ("/v1/completions", _completion(stream=False, stream_options=None), None),
    ("/v1/chat/completions", _chat(stream=False, stream_options={"include_usage": False}), "stream_options"),
    ("/v1/responses", {"model": MODEL, "input": "hi", "max_output_tokens": 2, "stream_options": {}}, "stream_options"),
    ("/v1/chat/completions", _chat(messages=[{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Oh"}],
                                   continue_final_message=True, add_generation_prompt=False), None),
    ("/detokenize", {"tokens": [5]}, None),
    ("/detokenize", {"tokens": [5.0]}, None),
    ("/detokenize", {"tokens": [-1]}, "tokens"),
]


@pytest.mark.parametrize("path, body, refused", BODIES)
def test_the_server_enforces_what_the_document_says(doc: dict[str, Any], server: ServerThread, engine: AsyncLLM,
                                                    path: str, body: dict[str, Any], refused: str | None) -> None:
    if body.get("prompt") == "vocab":
        body = {**body, "prompt": [engine.limits().vocab_size]}
    assert validator(doc, request_schema(doc, path)).is_valid(body) == (refused is None)
    r = post_json(server.url + path, body)
    if refused is None:
        assert r.status_code == 200, r.text
    else:
        assert r.status_code == 400 and r.json()["error"]["param"] == refused, r.text
        validator(doc, "#/components/schemas/ErrorResponse").validate(r.json())


@pytest.mark.parametrize("literal, refused", [
    (b"-9223372036854775809.0", True),  # past the range; its float is -2**63, inside it: not rounded in
    (b"9007199254740993.5", True),  # its float is integral; the literal is not an integer
    (b"-9223372036854775808.0", False), (b"1e18", False), (b"123456789012345678", False),
    (b"9.223372036854775807e18", False), (b"9.223372036854775808e18", True)])  # the last integer, the first past
def test_number_literals_are_read_as_written(server: ServerThread, literal: bytes, refused: bool) -> None:
    """As written, not as a float rounds them: an integer field takes a literal whose value is an integer in its
    range, however it is spelled, and refuses by name one whose float would be, but the literal is not."""
    body = b'{"prompt": "Hi", "max_tokens": 1, "seed": ' + literal + b'}'
    r = httpx.post(server.url + "/v1/completions", content=body, headers={"content-type": "application/json"},
                   timeout=60)
    got = (r.status_code, r.json().get("error", {}).get("param"))
    assert got == ((400, "seed") if refused else (200, None)), r.text
    temperature = httpx.post(server.url + "/v1/completions", content=b'{"prompt": "Hi", "max_tokens": 1, '
                             b'"temperature": 0.50000000000000000001}', headers={"content-type": "application/json"},
                             timeout=60)
    assert temperature.status_code == 200, temperature.text  # (a number field takes the float it is)


def test_every_streamed_event_fits_the_documented_event_schema(doc: dict[str, Any], server: ServerThread) -> None:
    """schemathesis (ST108) reads an event stream event by event; the document once called the stream a string."""
    schema = doc["paths"]["/v1/completions"]["post"]["responses"]["200"]["content"]["text/event-stream"]["schema"]
    body = {"prompt": "A friend is", "max_tokens": 3, "stream": True}
    with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=60) as r:
        assert r.status_code == 200, r.read()
        events = [{"data": line[len("data: "):]} for line in r.iter_lines() if line.startswith("data: ")]
    assert len(events) >= 2 and events[-1] == {"data": "[DONE]"}
    for event in events:
        jsonschema.validate(event, schema)
