"""``--reasoning-parser qwen3`` through the server with the real ``openai`` client: the thinking block
in ``reasoning_content``, the answer in ``content``, streamed as separate deltas that join to the
whole response. The embedded default model does not think, so a regex constraint makes it write a
thinking block."""
from __future__ import annotations

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
