"""Reasoning parsers (``vtcore serve --reasoning-parser NAME``, vLLM's flag): a reasoning model's
thinking block goes to the chat message's ``reasoning_content``, the rest to ``content``.

``qwen3`` (Qwen3, Qwen3.5): an output that begins with ``<think>`` is reasoning up to ``</think>`` (all
of it when the block never closes: a truncated thought is not an answer), then the answer, its
leading newlines dropped; an output that does not begin with the tag is all answer (thinking off,
``chat_template_kwargs={"enable_thinking": false}``). Streaming splits each delta by the same rule,
holding back only a possible partial tag, so the streamed parts join to the whole response's.
"""
from __future__ import annotations


class ThinkSplitter:
    """One output's split, fed its text in deltas: ``feed`` and ``flush`` give (reasoning, content)."""

    START, END = "<think>", "</think>"

    def __init__(self) -> None:
        self.state = "start"  # start -> reasoning -> after (newlines dropped) -> content
        self.held = ""
        self.thought = False  # the output began with the start tag

    def feed(self, text: str) -> tuple[str, str]:
        reasoning, content = "", ""
        text = self.held + text
        self.held = ""
        while text:
            if self.state == "start":
                if text.startswith(self.START):
                    text, self.state, self.thought = text[len(self.START):], "reasoning", True
                elif self.START.startswith(text):
                    self.held, text = text, ""
                else:
                    self.state = "content"
            elif self.state == "reasoning":
                end = text.find(self.END)
                if end >= 0:
                    reasoning += text[:end]
                    text, self.state = text[end + len(self.END):], "after"
                else:
                    keep = partial_suffix(text, self.END)
                    reasoning += text[:len(text) - keep]
                    self.held, text = text[len(text) - keep:], ""
            elif self.state == "after":
                text = text.lstrip("\n")
                if text:
                    self.state = "content"
            else:
                content += text
                text = ""
        return reasoning, content

    def flush(self) -> tuple[str, str]:
        """The held-back text once the output has ended."""
        held, self.held = self.held, ""
        return (held, "") if self.state == "reasoning" else ("", held if self.state in ("start", "content") else "")


def partial_suffix(text: str, tag: str) -> int:
    """The length of the longest suffix of ``text`` that begins ``tag`` (it may continue as the tag)."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0


REASONING_PARSERS = {"qwen3": ThinkSplitter}


def split_reasoning(splitter: ThinkSplitter, text: str) -> tuple[str | None, str]:
    """A whole output's (reasoning, or None when it had no thinking block; content), by a fresh ``splitter``."""
    parts = [splitter.feed(text), splitter.flush()]
    return ("".join(r for r, _ in parts) if splitter.thought else None), "".join(c for _, c in parts)
