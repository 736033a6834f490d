"""The tool-call formats the family plugins supply: each parser reads what its grammar (tool_choice
"required" / named) makes the embedded default model write, arguments valid against the schema."""
from __future__ import annotations

import json

import jsonschema
import pytest

from vtcore import LLM, SamplingParams
from vtcore.server.tool_calls import CallStream, HermesToolParser, Qwen3XMLToolParser, split_calls
from vtcore.structured import StructuredOutputsParams
from vtcore.structured.grammar import GrammarRefused

WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 8},
                                            "days": {"type": "integer", "minimum": 1, "maximum": 7}},
           "required": ["city", "days"]}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}},
         {"type": "function", "function": {"name": "ping", "parameters": {"type": "object", "properties": {},
                                                                            "required": []}}}]


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM(device="cpu", max_num_seqs=8)


@pytest.mark.parametrize("parser", [HermesToolParser, Qwen3XMLToolParser])
@pytest.mark.parametrize("many", [False, True])
def test_the_grammar_writes_what_the_parser_reads(llm: LLM, parser, many) -> None:
    params = [SamplingParams(temperature=1.0, seed=s, max_tokens=300, structured_outputs=StructuredOutputsParams(
        grammar=parser.block_grammar(TOOLS, many))) for s in range(4)]
    for out in llm.generate(["Call a tool:"] * len(params), params, use_tqdm=False):
        text = out.outputs[0].text
        assert out.outputs[0].finish_reason == "stop", text
        content, calls = split_calls(parser, text)
        assert content == "" and calls and (many or len(calls) == 1), text
        for name, args in calls:
            assert name in ("get_weather", "ping")
            if name == "get_weather":
                jsonschema.validate(json.loads(args), WEATHER)


@pytest.mark.parametrize("parser", [HermesToolParser, Qwen3XMLToolParser])
@pytest.mark.parametrize("parameters", [
    {"type": "object", "required": ["a"], "properties": {"a": {"type": "nope"}}},  # xgrammar's refusal
    {"type": "object", "required": ["a"], "properties": []},  # (Qwen3's XML grammar reads the properties itself)
])
def test_a_tool_no_grammar_can_express_is_refused_naming_it(parser, parameters) -> None:
    """Named for the server's 400 (``forced_calls``), not a 500 from inside xgrammar or the parser."""
    tools = [TOOLS[1], {"type": "function", "function": {"name": "bad", "parameters": parameters}}]
    with pytest.raises(GrammarRefused, match="^function 'bad': xgrammar cannot compile it: "):
        parser.block_grammar(tools, False)


def test_xml_values_are_typed_by_the_tools_schema() -> None:
    """A string parameter keeps its text even where it reads as JSON (an id of digits, "true"); the other
    types are the JSON their text reads as; a parameter the tools do not describe falls back to JSON."""
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {
        "id": {"type": "string"}, "flag": {"type": ["string", "null"]}, "color": {"enum": ["1", "2"]},
        "n": {"type": "integer"}, "ok": {"type": "boolean"}, "tags": {"type": "array"}}}}}]
    params = {"id": "00123", "flag": "true", "color": "2", "n": "7", "ok": "false", "tags": '["a", 1]', "extra": "5"}
    block = "<tool_call>\n<function=f>\n" + "".join(f"<parameter={k}>\n{v}\n</parameter>\n" for k, v in params.items()) \
        + "</function>\n</tool_call>"
    assert split_calls(Qwen3XMLToolParser, block, tools) == ("", [("f", json.dumps(
        {"id": "00123", "flag": "true", "color": "2", "n": 7, "ok": False, "tags": ["a", 1], "extra": 5}))])
    assert split_calls(Qwen3XMLToolParser, block.replace("00123", "123"), tools)[1][0][1].startswith('{"id": "123"')
    stream = CallStream(Qwen3XMLToolParser, tools)  # streaming types the same way
    assert stream.feed(block[:20])[1] == [] and json.loads(stream.feed(block[20:])[1][0][1])["id"] == "00123"
    untyped = split_calls(Qwen3XMLToolParser, block.replace("00123", "123"), [{"type": "function"}, "junk"])
    assert json.loads(untyped[1][0][1])["id"] == 123  # no schema for f: JSON where it parses


def test_xml_values_read_as_json_where_they_parse() -> None:
    block = ("<tool_call>\n<function=f>\n<parameter=n>\n3\n</parameter>\n<parameter=s>\nhello world\n</parameter>\n"
             "<parameter=o>\n{\"a\": [1]}\n</parameter>\n</function>\n</tool_call>")
    assert split_calls(Qwen3XMLToolParser, "x " + block) == (
        "x", [("f", json.dumps({"n": 3, "s": "hello world", "o": {"a": [1]}}))])
    assert split_calls(Qwen3XMLToolParser, "<tool_call>no function</tool_call>") == (
        "<tool_call>no function</tool_call>", [])


@pytest.mark.parametrize("parser", [HermesToolParser, Qwen3XMLToolParser])
def test_streamed_content_joins_to_the_whole_outputs_around_calls(parser) -> None:
    """White space before, between and after calls: the whole output's content is stripped, and the deltas,
    cut anywhere, join to it (the stream held no white space back, so it sent "Let me check. " and "\\n")."""
    import random

    call = ('<tool_call>\n{"name": "f", "arguments": {"a": 1}}\n</tool_call>' if parser is HermesToolParser else
            "<tool_call>\n<function=f>\n<parameter=a>\n1\n</parameter>\n</function>\n</tool_call>")
    rng = random.Random(0)
    for whole, content, n in [(" Let me check. " + call + " done\n", "Let me check.  done", 1),
                              (call + "\n" + call + "\n", "", 2), ("plain  text ", "plain  text", 0)]:
        assert (split_calls(parser, whole)[0], len(split_calls(parser, whole)[1])) == (content, n)
        for _ in range(30):
            cuts = sorted(rng.sample(range(len(whole) + 1), 6))
            stream, joined, calls = CallStream(parser), "", []
            for piece in [whole[i:j] for i, j in zip([0] + cuts, cuts + [len(whole)])]:
                text, done = stream.feed(piece)
                joined, calls = joined + text, calls + done
            text, done = stream.flush()
            assert (joined + text, calls + done) == split_calls(parser, whole), cuts
