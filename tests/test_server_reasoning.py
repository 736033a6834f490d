"""``--reasoning-parser qwen3`` through the server with the real ``openai`` client: the thinking block
in ``reasoning_content``, the answer in ``content``, streamed as separate deltas that join to the
whole response. The embedded default model does not think, so a regex constraint makes it write a
thinking block."""
from __future__ import annotations

import json
from typing import Any, Iterator

import pytest
from server_harness import MODEL, ServerThread, engine, needs_default_model  # noqa: F401

openai = pytest.importorskip("openai")
pytestmark = needs_default_model

THINKING = {"regex": "<think>\\n[a-z ]{3,12}\\n</think>\\n\\n[a-z]{2,8}"}


@pytest.fixture(scope="module")
def client(engine: Any) -> Iterator[Any]:  # noqa: F811
    from vtcore.server.app import build_app

    with ServerThread(build_app(engine, MODEL, reasoning_parser="qwen3")) as server:
        yield openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0)


def _chat(client: Any, stream: bool = False, **extra: Any) -> Any:
    return client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Think, then answer"}],
                                          max_tokens=60, temperature=1.0, seed=5, stream=stream,
                                          extra_body=extra)


def test_the_thinking_block_is_reasoning_content(client: Any) -> None:
    msg = _chat(client, structured_outputs=THINKING).choices[0].message
    reasoning = msg.model_extra["reasoning_content"]
    assert reasoning.startswith("\n") and reasoning.endswith("\n") and "<think>" not in reasoning, reasoning
    assert msg.content.isalpha() and "</think>" not in msg.content, msg.content


def test_streamed_deltas_join_to_the_whole_split(client: Any) -> None:
    whole = _chat(client, structured_outputs=THINKING).choices[0].message
    reasoning = content = ""
    for chunk in _chat(client, stream=True, structured_outputs=THINKING):
        if chunk.choices:
            delta = chunk.choices[0].delta
            reasoning += (delta.model_extra or {}).get("reasoning_content") or ""
            content += delta.content or ""
    assert (reasoning, content) == (whole.model_extra["reasoning_content"], whole.content)


def test_an_answer_without_thinking_has_no_reasoning(client: Any) -> None:
    msg = _chat(client, structured_outputs={"regex": "[a-z]{2,8}"}).choices[0].message
    assert msg.model_extra["reasoning_content"] is None and msg.content.isalpha()


def test_an_unknown_parser_is_refused_by_name(engine: Any) -> None:  # noqa: F811
    from vtcore.server.app import build_app

    with pytest.raises(ValueError, match=r"reasoning_parser='deepseek': expected one of \['qwen3'\]"):
        build_app(engine, MODEL, reasoning_parser="deepseek")


def test_a_response_format_constrains_the_answer_not_the_thought(client: Any) -> None:
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}
    fmt = {"type": "json_schema", "json_schema": {"name": "r", "schema": schema}}
    thought = 0  # a schema over the whole output would never let it open a thinking block
    for seed in range(6):
        choice = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Think, then JSON"}],
                                                max_tokens=200, temperature=1.0, seed=seed,
                                                response_format=fmt).choices[0]
        thought += choice.message.model_extra["reasoning_content"] is not None
        if choice.finish_reason == "length":  # a thought that ran to max_tokens leaves no answer
            assert choice.message.model_extra["reasoning_content"] and not choice.message.content
            continue
        assert json.loads(choice.message.content) in ({"ok": True}, {"ok": False}), choice.message
    assert thought


def test_the_thinking_grammar_takes_a_thought_then_the_answer() -> None:
    from vtcore.config import DEFAULT_MODEL
    from vtcore.engine.tokenizer import load_tokenizer
    from vtcore.structured import StructuredOutputsParams
    from vtcore.structured.grammar import GrammarCache, after_thinking

    tok = load_tokenizer(DEFAULT_MODEL)
    cache = GrammarCache(tok, 2048, [2])
    params = after_thinking(StructuredOutputsParams(regex="[a-z]{2}"), "<think>", "</think>")

    def accepts(text: str) -> bool:
        grammar = cache.matcher(params)
        return all(grammar.accept(t) for t in tok.encode(text, add_special_tokens=False)) and grammar.accept(2)

    assert accepts("<think>\nsome </thin </ thought\n</think>\n\nok") and accepts("ok")
    assert not accepts("<think>a</think>b</think>ok")  # the end tag inside the thought ends it
    assert not accepts("<think>a</think>okk")
