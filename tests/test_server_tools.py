"""Tool calling through the server with the real ``openai`` client, over a chat template in Qwen3's
tool format written for these tests (the embedded default model's own template has no tools): the
hermes parser the qwen3_dense plugin supplies (``vtcore_tool_parser``), tool_choice required / named /
auto / none, streamed tool-call deltas, and a round trip with the tool's answer in the history."""
from __future__ import annotations

import json
import random
from typing import Any, Iterator

import jsonschema
import pytest
from server_harness import MODEL, engine, needs_default_model, template_server  # noqa: F401

from vtcore.server.tool_calls import CallStream, HermesToolParser, split_calls

openai = pytest.importorskip("openai")
pytestmark = needs_default_model

TEMPLATE = """{%- if tools %}<|im_start|>system
# Tools

You are provided with function signatures within <tools></tools> XML tags:
<tools>{% for tool in tools %}
{{ tool | tojson }}{% endfor %}
</tools>

For each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:
<tool_call>
{"name": <function-name>, "arguments": <args-json-object>}
</tool_call><|im_end|>
{% endif %}
{%- for message in messages %}
{%- if message.role == "assistant" and message.tool_calls %}<|im_start|>assistant
{{ message.content or "" }}{% for tc in message.tool_calls %}
<tool_call>
{"name": "{{ tc.function.name }}", "arguments": {{ tc.function.arguments | tojson }}}
</tool_call>{% endfor %}<|im_end|>
{% elif message.role == "tool" %}<|im_start|>user
<tool_response>
{{ message.content }}
</tool_response><|im_end|>
{% else %}<|im_start|>{{ message.role }}
{{ message.content }}<|im_end|>
{% endif %}{%- endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""

WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 8},
                                            "unit": {"enum": ["c", "f"]}}, "required": ["city", "unit"]}
CLOCK = {"type": "object", "properties": {"zone": {"type": "integer", "minimum": -12, "maximum": 12}},
         "required": ["zone"]}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather now", "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time", "parameters": CLOCK}}]
SCHEMAS = {"get_weather": WEATHER, "get_time": CLOCK}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def client(engine: Any) -> Iterator[Any]:  # noqa: F811
    with template_server(engine, TEMPLATE) as server:
        yield openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0)


def _chat(client: Any, messages: list = ASK, **kw: Any) -> Any:
    return client.chat.completions.create(**{"model": MODEL, "messages": messages, "tools": TOOLS, "max_tokens": 200,
                                             "temperature": 1.0, "seed": 3, **kw})


def _valid(call: Any) -> None:
    assert call.type == "function" and call.id.startswith("chatcmpl-tool-")
    jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


def test_required_gives_valid_calls_and_a_round_trip(client: Any) -> None:
    out = _chat(client, tool_choice="required").choices[0]
    assert out.finish_reason == "tool_calls" and out.message.content is None and out.message.tool_calls
    for call in out.message.tool_calls:
        _valid(call)
    history = ASK + [out.message.model_dump(exclude_unset=True)] + [
        {"role": "tool", "tool_call_id": c.id, "content": "22 C, sunny"} for c in out.message.tool_calls]
    answer = _chat(client, history, tool_choice="none", max_tokens=8).choices[0]
    assert answer.message.tool_calls in (None, []) and isinstance(answer.message.content, str)


def test_a_named_function_is_the_one_called_and_finishes_stop(client: Any) -> None:
    """A named function's call ends with "stop" (vLLM's and OpenAI's), streamed and not; "required" and "auto" give
    "tool_calls" (the other tests)."""
    named = {"type": "function", "function": {"name": "get_time"}}
    out = _chat(client, tool_choice=named).choices[0]
    assert [c.function.name for c in out.message.tool_calls] == ["get_time"] and out.finish_reason == "stop"
    _valid(out.message.tool_calls[0])
    chunks = [c.choices[0] for c in _chat(client, tool_choice=named, stream=True) if c.choices]
    assert [c.finish_reason for c in chunks if c.finish_reason] == ["stop"]
    assert [d.function.name for c in chunks for d in c.delta.tool_calls or []] == ["get_time"]


def test_parallel_tool_calls_false_gives_one_call(client: Any) -> None:
    for seed in range(3):
        out = _chat(client, tool_choice="required", parallel_tool_calls=False, seed=seed).choices[0]
        assert len(out.message.tool_calls) == 1


def test_streamed_tool_calls_equal_the_whole_response(client: Any) -> None:
    whole = _chat(client, tool_choice="required").choices[0]
    calls: dict[int, dict] = {}
    finish = None
    empty = 0
    for chunk in _chat(client, tool_choice="required", stream=True):
        if not chunk.choices:
            continue
        c = chunk.choices[0]
        finish = c.finish_reason or finish
        empty += not (c.delta.content or c.delta.tool_calls or c.delta.role or c.finish_reason)
        for d in c.delta.tool_calls or []:
            entry = calls.setdefault(d.index, {"name": "", "arguments": ""})
            entry["name"] += d.function.name or ""
            entry["arguments"] += d.function.arguments or ""
    assert finish == "tool_calls" and empty == 0  # (a chunk a token of the call's markup, empty, was sent)
    assert [calls[i] for i in sorted(calls)] == [{"name": t.function.name, "arguments": t.function.arguments}
                                                 for t in whole.message.tool_calls]


def test_auto_parses_a_call_the_model_writes(client: Any) -> None:
    """With tool_choice auto the output is parsed; a regex makes the tiny model write a hermes block."""
    block = '<tool_call>\\n\\{"name": "get_weather", "arguments": \\{"city": "[a-z]{3,6}", "unit": "c"\\}\\}\\n</tool_call>'
    out = _chat(client, tool_choice="auto", extra_body={"structured_outputs": {"regex": "[a-z]{2,5} " + block}})
    msg = out.choices[0].message
    assert out.choices[0].finish_reason == "tool_calls" and msg.content.isalpha(), msg
    assert [c.function.name for c in msg.tool_calls] == ["get_weather"]
    _valid(msg.tool_calls[0])


def test_none_renders_no_tools_and_parses_nothing(client: Any) -> None:
    out = _chat(client, tool_choice="none", max_tokens=6).choices[0]
    assert not out.message.tool_calls and out.finish_reason in ("stop", "length")


TEXTS = [
    ('hi <tool_call>\n{"name": "f", "arguments": {"a": 1}}\n</tool_call>', ("hi", [("f", '{"a": 1}')])),
    ('<tool_call>{"name": "f", "arguments": {}}</tool_call>\n<tool_call>{"name": "g", "arguments": "{}"}</tool_call>',
     ("", [("f", "{}"), ("g", "{}")])),
    ("<tool_call>not json</tool_call> x", ("<tool_call>not json</tool_call> x", [])),
    ('<tool_call>{"name": "f"', ('<tool_call>{"name": "f"', [])),  # unclosed: content
    ("plain <tool", ("plain <tool", [])),
]


@pytest.mark.parametrize("text, expected", TEXTS)
def test_hermes_blocks_split_alike_whole_and_in_any_deltas(text, expected) -> None:
    assert split_calls(HermesToolParser, text) == expected
    rng = random.Random(0)
    for _ in range(40):
        cuts = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, rng.randrange(1, 6))))
        stream, content, calls = CallStream(HermesToolParser), "", []
        for a, b in zip([0, *cuts], [*cuts, len(text)]):
            c, got = stream.feed(text[a:b])
            content, calls = content + c, calls + got
        rest, _ = stream.flush()
        assert ((content + rest).strip(), calls) == expected, cuts


def test_vllms_tool_flags_are_taken_and_the_parser_name_checked(engine: Any) -> None:  # noqa: F811
    """``vtcore serve --enable-auto-tool-choice --tool-call-parser NAME`` as vLLM's command lines: the name must
    be the served family's own format (the plugin's parser), else the start fails saying which it is."""
    from vtcore.cli.main import build_parser
    from vtcore.server.serve import _check_tool_call_parser
    from vtcore.server.tool_calls import Qwen3XMLToolParser

    args = build_parser().parse_args(["serve", "--enable-auto-tool-choice", "--tool-call-parser", "hermes"])
    assert args.enable_auto_tool_choice and args.tool_call_parser == "hermes"
    assert engine.tool_parser() is HermesToolParser
    _check_tool_call_parser("hermes", engine)
    with pytest.raises(ValueError, match=r"^--tool-call-parser 'qwen3_coder': the served family '[a-z0-9_]+' parses "
                                         r"its tool calls as hermes; expected that name"):
        _check_tool_call_parser("qwen3_coder", engine)
    assert Qwen3XMLToolParser.names[0] == "qwen3_coder"


def test_a_tool_call_parser_for_a_family_without_one_is_refused_at_start(capsys: Any) -> None:
    """In-process ``vtcore serve``: the check runs once the engine is up, and the error names the flag."""
    from vtcore.cli.main import main

    rc = main(["serve", "--device", "cpu", "--port", "0", "--tool-call-parser", "mistral"])
    err = capsys.readouterr().err
    assert rc != 0 and "--tool-call-parser 'mistral'" in err and "hermes" in err, err
