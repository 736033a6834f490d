"""The qwen3 reasoning parser: a whole output's split, and every way of cutting it into deltas
joining to the same split (a tag may arrive cut anywhere)."""
from __future__ import annotations

import random

import pytest

from vtcore.server.reasoning import ThinkSplitter, split_reasoning

CASES = [
    ("<think>\nstep one\n</think>\n\nThe answer.", ("\nstep one\n", "The answer.")),
    ("The answer, no thinking.", (None, "The answer, no thinking.")),
    ("<think>cut off mid-thou", ("cut off mid-thou", "")),  # truncated: reasoning, no answer
    ("<think></think>answer </think> kept", ("", "answer </think> kept")),
    ("<th", (None, "<th")),  # a prefix of the tag that never completes is content
    ("<think>a </thi", ("a </thi", "")),
    (" <think>x</think>y", (None, " <think>x</think>y")),  # the tag must open the output
]


@pytest.mark.parametrize("text, expected", CASES)
def test_a_whole_output_splits(text, expected) -> None:
    assert split_reasoning(ThinkSplitter(), text) == expected


@pytest.mark.parametrize("text, expected", CASES)
def test_any_cut_into_deltas_joins_to_the_whole_split(text, expected) -> None:
    rng = random.Random(0)
    for _ in range(50):
        cuts = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, rng.randrange(1, 6))))
        splitter, reasoning, content = ThinkSplitter(), "", ""
        for a, b in zip([0, *cuts], [*cuts, len(text)]):
            r, c = splitter.feed(text[a:b])
            reasoning, content = reasoning + r, content + c
        r, c = splitter.flush()
        assert ((reasoning + r) if splitter.thought else None, content + c) == expected, cuts
