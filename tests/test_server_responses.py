"""``POST /v1/responses`` (OpenAI's Responses API as vLLM serves it) through the real ``openai`` client: the
answer is the chat endpoint's for the same conversation, streamed as OpenAI's typed events whose deltas join to
it, ``text.format`` constrains it, what is not served is refused naming the field, a reasoning parser puts the
thinking block in a reasoning item before the message, streamed or not, and function tools (over the tool template
of ``test_server_tools``) give ``function_call`` items, streamed alike, whose round trip renders as a chat's."""
from __future__ import annotations

import json
from typing import Any, Iterator

import jsonschema
import pytest

from tests.server_harness import (MODEL, ServerThread, client, engine, error_of, httpx, needs_default_model, server,
                                  template_server)
from tests.test_server_tools import ASK, SCHEMAS, TEMPLATE, TOOLS
from vtcore.server.generation import Delta
from vtcore.server.reasoning import ThinkSplitter
from vtcore.server.responses import ResponsesEndpoint, _OutputEvents
from vtcore.server.responses_protocol import ResponsesRequest

openai = pytest.importorskip("openai")
pytestmark = needs_default_model
__all__ = ["client", "engine", "server"]  # (the module fixtures this file uses)


def _chat(client: Any, messages: list[dict[str, Any]], n: int) -> Any:
    return client.chat.completions.create(model=MODEL, messages=messages, max_tokens=n, temperature=0)


def test_the_answer_is_the_chats_for_the_same_conversation(client: Any) -> None:
    r = client.responses.create(model=MODEL, input="The meaning of life is", instructions="Answer briefly.",
                                max_output_tokens=9, temperature=0, metadata={"run": "a"})
    chat = _chat(client, [{"role": "system", "content": "Answer briefly."},
                          {"role": "user", "content": "The meaning of life is"}], 9)
    assert r.output_text == chat.choices[0].message.content and r.object == "response" and r.id.startswith("resp_")
    assert r.usage.input_tokens == chat.usage.prompt_tokens and r.usage.output_tokens == 9
    assert r.usage.total_tokens == chat.usage.total_tokens and r.metadata == {"run": "a"}
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"  # cut at its length
    (item,) = r.output
    assert item.type == "message" and item.role == "assistant" and item.status == "incomplete"
    assert item.id.startswith("msg_") and item.content[0].type == "output_text"


def test_messages_of_parts_and_roles_render_as_a_chats(client: Any) -> None:
    given = [{"role": "developer", "content": "Be kind."},
             {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Hi"},
                                                              {"type": "input_text", "text": "there"}]},
             {"role": "assistant", "content": [{"type": "output_text", "text": "Hello."}]},
             {"role": "user", "content": "A friend is"}]
    r = client.responses.create(model=MODEL, input=given, max_output_tokens=7, temperature=0)
    chat = _chat(client, [{"role": "system", "content": "Be kind."}, {"role": "user", "content": "Hi\nthere"},
                          {"role": "assistant", "content": "Hello."}, {"role": "user", "content": "A friend is"}], 7)
    assert r.output_text == chat.choices[0].message.content and r.usage.input_tokens == chat.usage.prompt_tokens


def test_a_stream_is_openais_events_and_joins_to_the_whole_answer(client: Any, server: Any) -> None:
    kw = dict(model=MODEL, input="Once upon a time", max_output_tokens=10, temperature=0)
    whole = client.responses.create(**kw)
    with client.responses.stream(**kw) as stream:
        events = list(stream)
        final = stream.get_final_response()
    kinds = [e.type for e in events]
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          "response.completed"]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    deltas = [e.delta for e in events if e.type == "response.output_text.delta"]
    assert "".join(deltas) == whole.output_text == final.output_text and len(deltas) >= 2
    assert events[0].response.status == "in_progress" and final.status == "incomplete"
    assert final.usage.output_tokens == 10 and final.id == events[0].response.id
    with httpx.stream("POST", server.url + "/v1/responses", json={**kw, "stream": True}, timeout=60) as raw:
        lines = [line for line in raw.iter_lines() if line]
    assert lines[0] == "event: response.created" and json.loads(lines[1][6:])["type"] == "response.created"
    assert "data: [DONE]" not in lines


def test_text_format_constrains_the_answer(client: Any) -> None:
    schema = {"type": "object", "properties": {"kind": {"enum": ["cat", "dog"]}, "legs": {"type": "integer",
              "minimum": 0, "maximum": 4}}, "required": ["kind", "legs"], "additionalProperties": False}
    r = client.responses.create(model=MODEL, input="A pet in JSON:", max_output_tokens=300, temperature=1.0, text={
        "format": {"type": "json_schema", "name": "pet", "schema": schema, "strict": True}}, extra_body={"seed": 1})
    jsonschema.validate(json.loads(r.output_text), schema)
    assert r.text.format.type == "json_schema" and r.status == "completed"


@pytest.mark.parametrize("extra,field", [
    ({"previous_response_id": "resp_1"}, "previous_response_id"), ({"background": True}, "background"),
    ({"reasoning": {"effort": "low"}}, "reasoning"), ({"include": ["file_search_call.results"]}, "include"),
    ({"top_logprobs": 2}, "top_logprobs"),
    ({"tools": [{"type": "web_search"}]}, "tools"), ({"n": 2}, "n"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, "input"),
    ({"text": {"format": {"type": "json_object"}}, "structured_outputs": {"regex": "a"}}, "structured_outputs"),
    ({"text": {"format": {"type": "json_schema", "name": "x"}}}, "text.format.schema"),
    ({"input": []}, "input"), ({"return_token_ids": True}, "return_token_ids"),
    ({"max_output_tokens": 10 ** 6}, "max_output_tokens")])
def test_what_is_not_served_is_refused_by_name(client: Any, extra: dict[str, Any], field: str) -> None:
    body = {"model": MODEL, "input": "Hi", "max_output_tokens": 4, **extra}
    with pytest.raises(openai.BadRequestError) as info:
        client.responses.create(**{k: v for k, v in body.items() if k in ("model", "input")},
                                extra_body={k: v for k, v in body.items() if k not in ("model", "input")})
    err = error_of(info.value)
    assert field in err["message"] or err["param"] == field, err


def test_a_reasoning_parser_puts_the_thought_in_a_reasoning_item_streamed_or_not() -> None:
    text = "<think>\nweigh it</think>\n\nThe answer."
    pieces = ["<th", "ink>\nwei", "gh it</thi", "nk>\n", "\nThe ans", "wer."]
    stream = _OutputEvents(ThinkSplitter)
    events = [e for piece in pieces for e in stream.chunks(None, Delta(piece, [], [], None, None, 0))]
    events += stream.close("stop")
    kinds = [k for k, _ in events]
    assert kinds[0] == "response.output_item.added" and events[0][1]["item"]["type"] == "reasoning"
    assert "".join(f["delta"] for k, f in events if k == "response.reasoning_text.delta") == "\nweigh it"
    assert "".join(f["delta"] for k, f in events if k == "response.output_text.delta") == "The answer."
    assert [f["output_index"] for k, f in events if k == "response.output_item.done"] == [0, 1]
    whole = ResponsesEndpoint.response_choice(_Parser(), None, _Done(text))["output"]
    assert [(i["type"], i["content"][0]["text"]) for i in stream.items] == [
        (i["type"], i["content"][0]["text"]) for i in whole] == [("reasoning", "\nweigh it"),
                                                                 ("message", "The answer.")]


class _Parser:
    reasoning_parser = ThinkSplitter
    wants_logprobs = staticmethod(lambda body: False)

    @staticmethod
    def offered(body: Any) -> None:
        return None


class _Done:
    def __init__(self, text: str) -> None:
        self.text, self.finish_reason = text, "stop"


# ------------------------------------------------------------------------------------------- tools
FN_TOOLS = [{"type": "function", "name": t["function"]["name"], "description": t["function"].get("description"),
             "parameters": t["function"]["parameters"]} for t in TOOLS]


@pytest.fixture(scope="module")
def tool_client(engine: Any) -> Iterator[Any]:
    with template_server(engine, TEMPLATE) as srv:
        yield openai.OpenAI(base_url=f"{srv.url}/v1", api_key="none", max_retries=0)


def _ask(client: Any, **kw: Any) -> Any:
    return client.responses.create(**{"model": MODEL, "input": ASK[0]["content"], "tools": FN_TOOLS,
                                      "max_output_tokens": 200, "temperature": 1.0, "extra_body": {"seed": 3}, **kw})


def test_required_calls_are_function_call_items_and_a_round_trip_renders_as_a_chats(tool_client: Any) -> None:
    r = _ask(tool_client, tool_choice="required")
    calls = [i for i in r.output if i.type == "function_call"]
    assert calls and not [i for i in r.output if i.type == "message"] and r.status == "completed"
    for call in calls:
        jsonschema.validate(json.loads(call.arguments), SCHEMAS[call.name])
        assert call.call_id.startswith("call_") and call.id.startswith("fc_")
    history = [{"role": "user", "content": ASK[0]["content"]}] + [
        {"type": "function_call", "call_id": c.call_id, "name": c.name, "arguments": c.arguments} for c in calls] + [
        {"type": "function_call_output", "call_id": c.call_id, "output": "22 C, sunny"} for c in calls]
    answer = tool_client.responses.create(model=MODEL, input=history, tools=FN_TOOLS, tool_choice="none",
                                          max_output_tokens=8, temperature=0)
    chat = tool_client.chat.completions.create(model=MODEL, tools=TOOLS, tool_choice="none", max_tokens=8,
                                               temperature=0, messages=ASK + [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": c.call_id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
            for c in calls]}] + [{"role": "tool", "tool_call_id": c.call_id, "content": "22 C, sunny"} for c in calls])
    assert answer.output_text == chat.choices[0].message.content
    assert answer.usage.input_tokens == chat.usage.prompt_tokens


def test_a_named_function_is_the_one_called_once(tool_client: Any) -> None:
    r = _ask(tool_client, tool_choice={"type": "function", "name": "get_time"})
    assert [i.name for i in r.output if i.type == "function_call"] == ["get_time"]


def test_streamed_calls_equal_the_whole_response(tool_client: Any) -> None:
    whole = _ask(tool_client, tool_choice="required")
    with tool_client.responses.stream(**{"model": MODEL, "input": ASK[0]["content"], "tools": FN_TOOLS,
                                         "max_output_tokens": 200, "temperature": 1.0, "extra_body": {"seed": 3},
                                         "tool_choice": "required"}) as stream:
        events = list(stream)
        final = stream.get_final_response()
    done = [(e.name, e.arguments) for e in events if e.type == "response.function_call_arguments.done"]
    assert done == [(i.name, i.arguments) for i in whole.output if i.type == "function_call"] == [
        (i.name, i.arguments) for i in final.output]
    assert [e.sequence_number for e in events] == list(range(len(events)))


def test_a_bad_tool_choice_is_named(tool_client: Any) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        _ask(tool_client, tool_choice={"type": "function", "name": "nope"})
    assert "'nope' is not among the tools" in error_of(info.value)["message"]
    with pytest.raises(openai.BadRequestError) as info:
        _ask(tool_client, tool_choice="required", text={"format": {"type": "json_object"}})
    assert error_of(info.value)["param"] == "tool_choice"


# ---------------------------------------------------------------------------------------- edge cases
def test_a_stream_the_engine_refuses_is_a_plain_400(client: Any) -> None:
    bad = {"type": "object", "properties": {"a": {"type": "integer", "minimum": 5, "maximum": 2}}}
    with pytest.raises(openai.BadRequestError) as info:
        with client.responses.stream(model=MODEL, input="hi", max_output_tokens=5,
                                     text={"format": {"type": "json_schema", "name": "x", "schema": bad}}) as s:
            list(s)
    err = error_of(info.value)
    assert err["param"] == "text.format.schema" and err["message"].startswith("text.format.schema: xgrammar cannot "
                                                                               "compile it: "), err


def test_a_forced_tool_xgrammar_cannot_compile_is_a_400_naming_the_tools(tool_client: Any) -> None:
    bad = [{"type": "function", "name": "f", "parameters": {"type": "nope"}}]
    with pytest.raises(openai.BadRequestError) as info:
        _ask(tool_client, tools=bad, tool_choice="required")
    err = error_of(info.value)
    assert err["param"] == "tools" and "function 'f': xgrammar cannot compile it" in err["message"], err


@pytest.mark.parametrize("extra,field", [({"add_generation_prompt": False}, "add_generation_prompt"),
                                         ({"continue_final_message": True}, "continue_final_message"),
                                         ({"max_completion_tokens": 2}, "max_completion_tokens"),
                                         ({"logprobs": True}, "logprobs"),
                                         ({"chat_template_kwargs": {"tools": []}}, "chat_template_kwargs")])
def test_chat_fields_are_refused_or_served_never_ignored(client: Any, extra: dict[str, Any], field: str) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        client.responses.create(model=MODEL, input="Hi", max_output_tokens=3, extra_body=extra)
    assert error_of(info.value)["param"] == field


@pytest.mark.parametrize("extra, message", [
    ({"tools": [{"type": "web_search"}]},
     "tools[0]: a tool of type 'web_search': not served; expected function (got "),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
     "input[0].content[0]: a content part of type 'input_image': not served; expected input_text or output_text "
     "(got ")])
def test_a_hosted_tool_or_an_image_is_refused_as_not_served(client: Any, extra: dict[str, Any], message: str) -> None:
    """(Not as a field the other kind lacks, nor under a model class's name.)"""
    with pytest.raises(openai.BadRequestError) as info:
        client.responses.create(model=MODEL, input="Hi", max_output_tokens=4, extra_body=extra)
    assert error_of(info.value)["message"].startswith(message), error_of(info.value)


def test_the_response_echoes_the_values_it_ran_with(client: Any, engine: Any) -> None:
    r = client.responses.create(model=MODEL, input="Hi", extra_body={"max_tokens": 3})
    assert r.temperature == engine.default_sampling().get("temperature", 1.0) and r.max_output_tokens == 3
    assert r.top_p == engine.default_sampling().get("top_p", 1.0) and r.usage.output_tokens <= 3
    assert client.responses.create(model=MODEL, input="Hi", max_output_tokens=0).max_output_tokens == 0


def test_an_aborted_response_is_cancelled_not_cut_at_its_length(server: Any) -> None:
    endpoint = ResponsesEndpoint(server.server.config.app.state.server)
    body = ResponsesRequest(input="Hi", max_output_tokens=4)
    job = endpoint.prepare(body)
    choice = job.choices[0]
    statuses = {}
    for finish in ("stop", "length", "abort"):
        choice.finish_reason = finish
        r = endpoint.response(body, job, choice, endpoint.response_choice(body, choice)["output"])
        statuses[finish] = (r["status"], r["incomplete_details"], r["output"][0]["status"])
    assert statuses == {"stop": ("completed", None, "completed"),
                        "length": ("incomplete", {"reason": "max_output_tokens"}, "incomplete"),
                        "abort": ("cancelled", None, "incomplete")}


def test_reasoning_tokens_count_the_thinking_block_by_its_tag_tokens() -> None:
    class Tokenizer:
        unk_token_id = 0

        @staticmethod
        def convert_tokens_to_ids(tag: str) -> int:
            return {"<think>": 7, "</think>": 8}[tag]

    fake = type("Endpoint", (), {"reasoning_parser": ThinkSplitter, "engine": type("E", (), {"tokenizer": Tokenizer})})
    count = ResponsesEndpoint.reasoning_tokens
    assert count(fake, [7, 1, 2, 8, 3]) == 4 and count(fake, [7, 1, 2]) == 3 and count(fake, [1, 7, 8]) == 0


def test_logprobs_are_the_chats_streamed_or_not(client: Any) -> None:
    kw = dict(model=MODEL, input="Once upon a time", max_output_tokens=6, temperature=0, top_logprobs=2,
              include=["message.output_text.logprobs"])
    r = client.responses.create(**kw)
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Once upon a time"}],
                                          max_tokens=6, temperature=0, logprobs=True, top_logprobs=2)
    got = [lp.model_dump() for lp in r.output[0].content[0].logprobs]
    want = [c.model_dump() for c in chat.choices[0].logprobs.content]
    assert got == want and len(got) == 6 and all(len(e["top_logprobs"]) == 2 for e in got)
    with client.responses.stream(**kw) as stream:
        events = list(stream)
    streamed = [lp.model_dump() for e in events if e.type == "response.output_text.delta" for lp in e.logprobs]
    done = [lp.model_dump() for e in events if e.type == "response.output_text.done" for lp in e.logprobs]
    assert streamed == done == got
    ids = client.responses.create(**kw, extra_body={"return_tokens_as_token_ids": True})
    assert [lp.token for lp in ids.output[0].content[0].logprobs] == [
        f"token_id:{t}" for t in client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "Once upon a time"}], max_tokens=6, temperature=0,
            extra_body={"return_token_ids": True}).choices[0].token_ids]


def test_beside_a_reasoning_parser_the_document_and_the_server_refuse_logprobs(engine: Any) -> None:
    from vtcore.server.app import build_app

    with ServerThread(build_app(engine, MODEL, reasoning_parser="qwen3")) as srv:
        body = {"model": MODEL, "input": "hi", "max_output_tokens": 2, "n": 1.0}
        assert httpx.post(srv.url + "/v1/responses", json=body, timeout=60).status_code == 200  # (1.0: an integer)
        r = httpx.post(srv.url + "/v1/responses", json={**body, "include": ["message.output_text.logprobs"]},
                       timeout=60)
        assert r.status_code == 400 and r.json()["error"]["param"] == "include", r.text
        doc = httpx.get(srv.url + "/openapi.json", timeout=60).json()
        (schema,) = [s for name, s in doc["components"]["schemas"].items() if "input" in s.get("properties", {})]
        include = schema["properties"]["include"]["anyOf"][0]
        assert include["maxItems"] == 0, include
