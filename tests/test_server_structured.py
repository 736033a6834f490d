"""Structured outputs through the OpenAI server, with the real ``openai`` client: ``response_format``
(JSON mode, JSON schema, ``chat.completions.parse`` with a pydantic model), vLLM's ``structured_outputs``,
and a schema xgrammar cannot compile refused by name while the server serves the rest."""
from __future__ import annotations

import json
import re
from typing import Any, Literal

import jsonschema
import pytest
from pydantic import BaseModel, Field
from server_harness import MODEL, client, engine, error_of, needs_default_model, server  # noqa: F401

openai = pytest.importorskip("openai")
pytestmark = needs_default_model

SCHEMA = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 10},
                                           "population": {"type": "integer", "minimum": 0, "maximum": 10**6}},
          "required": ["city", "population"]}


class Pet(BaseModel):
    kind: Literal["cat", "dog", "fish"]
    legs: int = Field(ge=0, le=4)
    name: str = Field(max_length=8)


def _chat(client: Any, **kw: Any) -> Any:
    args = dict(model=MODEL, messages=[{"role": "user", "content": "Describe it in JSON"}], max_tokens=300,
                temperature=1.0)
    return client.chat.completions.create(**{**args, **kw})


def test_json_schema_response_format_validates(client: Any) -> None:
    for seed in range(3):
        out = _chat(client, seed=seed, response_format={"type": "json_schema", "json_schema": {
            "name": "place", "schema": SCHEMA, "strict": True}})
        choice = out.choices[0]
        assert choice.finish_reason == "stop", choice.message.content
        jsonschema.validate(json.loads(choice.message.content), SCHEMA)


def test_json_object_mode_gives_an_object(client: Any) -> None:
    out = _chat(client, seed=4, response_format={"type": "json_object"})
    assert isinstance(json.loads(out.choices[0].message.content), dict)


def test_parse_with_a_pydantic_model(client: Any) -> None:
    out = client.chat.completions.parse(model=MODEL, messages=[{"role": "user", "content": "A pet, please"}],
                                        response_format=Pet, max_tokens=300, temperature=1.0, seed=1)
    pet = out.choices[0].message.parsed
    assert isinstance(pet, Pet) and pet.kind in ("cat", "dog", "fish") and 0 <= pet.legs <= 4


def test_vllm_structured_outputs_on_completions(client: Any) -> None:
    out = client.completions.create(model=MODEL, prompt="Pick one:", max_tokens=20, temperature=1.0, seed=3,
                                    extra_body={"structured_outputs": {"choice": ["left", "right", "up (2)"]}})
    assert out.choices[0].text in ("left", "right", "up (2)")
    out = client.completions.create(model=MODEL, prompt="Code:", max_tokens=20, temperature=1.0, seed=3,
                                    extra_body={"structured_outputs": {"regex": "[A-Z]{2}[0-9]{3}"}})
    assert re.fullmatch("[A-Z]{2}[0-9]{3}", out.choices[0].text), out.choices[0].text
    small = {"type": "integer", "minimum": 0, "maximum": 99}
    layout = {"json": {"type": "object", "properties": {"a": {"type": "array", "items": small, "maxItems": 3},
                                                        "b": {"type": "boolean"}}, "required": ["a", "b"]},
              "disable_any_whitespace": True}  # (no strings: no white space but json.dumps')
    for seed in range(3):
        text = client.completions.create(model=MODEL, prompt="JSON:", max_tokens=200, temperature=1.0, seed=seed,
                                         extra_body={"structured_outputs": layout}).choices[0].text
        assert text == json.dumps(json.loads(text)), text


def test_streaming_a_constrained_chat_gives_the_same_text(client: Any) -> None:
    fmt = {"type": "json_schema", "json_schema": {"name": "place", "schema": SCHEMA}}
    whole = _chat(client, seed=9, response_format=fmt).choices[0].message.content
    parts = [c.choices[0].delta.content or "" for c in _chat(client, seed=9, response_format=fmt, stream=True)
             if c.choices]
    assert "".join(parts) == whole


@pytest.mark.parametrize("kw, param", [
    (dict(response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nope"}}}),
     "response_format.json_schema.schema"),
    (dict(extra_body={"structured_outputs": {"grammar": "root ::= missing"}}), "structured_outputs"),
    (dict(extra_body={"structured_outputs": {"json": {"type": "nope"}}}), "structured_outputs"),
    (dict(tools=[{"type": "function", "function": {"name": "f", "parameters": {"type": "nope"}}}],
          tool_choice="required"), "tools"),
    (dict(extra_body={"structured_outputs": {"regex": "a", "choice": ["b"]}}), "structured_outputs"),
    (dict(response_format={"type": "json_object"}, extra_body={"structured_outputs": {"regex": "a"}}),
     "structured_outputs"),
])
def test_a_bad_constraint_is_a_400_and_the_server_serves_on(client: Any, kw: dict, param: str) -> None:
    with pytest.raises(openai.BadRequestError) as exc:
        _chat(client, **kw)
    err = error_of(exc.value)
    assert exc.value.status_code == 400 and err["type"] == "invalid_request_error", err
    assert err["param"] == param, err
    if "regex" not in str(kw):  # (what xgrammar refuses: named as sent, once, without xgrammar's C++ log prefix)
        assert err["message"].startswith(f"{param}: ") and err["message"].count("xgrammar cannot compile it") == 1
        assert "/cpp/" not in err["message"] and not err["message"].endswith("\n"), err
    if param == "tools":
        assert err["message"].startswith("tools: function 'f': xgrammar cannot compile it: "), err
    assert _chat(client, max_tokens=3).choices[0].message.content is not None


def test_a_constraint_is_built_once_for_the_servers_check(monkeypatch: pytest.MonkeyPatch) -> None:
    """``checked`` runs on the event loop for a light request, and a request may be checked more than once: each
    distinct constraint is built by xgrammar once, refused or not."""
    from vtcore.server import structured
    from vtcore.server.errors import APIError
    from vtcore.structured import StructuredOutputsParams

    built = []
    monkeypatch.setattr(structured, "grammar_of", lambda params: built.append(params.key()))
    structured._refusal.cache_clear()
    try:
        for _ in range(3):
            structured.checked(StructuredOutputsParams(json={"type": "object"}), "response_format.json_schema.schema")
        assert built == [("json", '{"type": "object"}', False)]
    finally:
        structured._refusal.cache_clear()
    monkeypatch.undo()
    for _ in range(2):  # a refusal is remembered too, and raised each time
        with pytest.raises(APIError, match="^structured_outputs: xgrammar cannot compile it: "):
            structured.checked(StructuredOutputsParams(regex="(unclosed"), "structured_outputs")
    assert structured._refusal.cache_info().hits >= 1

