"""Several stop strings: the output stops at the first to appear in full, whatever the tokens' boundaries
(it once stopped at the first in the list that the new token's text held, so a token holding two stop
strings could leave the earlier one in the output)."""
from __future__ import annotations

import pytest

from vtcore.engine.detokenizer import IncrementalDetokenizer


class PieceTokenizer:
    """Token i decodes to ``pieces[i]`` (no word-boundary rules, no special tokens)."""

    def __init__(self, pieces: list[str]) -> None:
        self.pieces = pieces

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return "".join(self.pieces[i] for i in ids)


def run(pieces: list[str], stop: list[str], include: bool = False) -> tuple[str | None, str]:
    """(the stop string that ended it, the output text) when the pieces arrive one token each."""
    detok = IncrementalDetokenizer(PieceTokenizer(pieces), [], True, stop, include)
    for token in range(len(pieces)):
        found = detok.add(token)
        if found is not None:
            return found, detok.visible_text(finished=True)
    return None, detok.visible_text(finished=True)


@pytest.mark.parametrize("pieces, stop, want", [
    (["Say hello world"], ["world", "hello"], ("hello", "Say ")),  # the later-listed one comes first
    (["xabcd"], ["abcd", "bc"], ("bc", "xa")),  # "bc" is complete before "abcd" is
    (["xa", "b", "c", "d"], ["abcd", "bc"], ("bc", "xa")),  # the same, a character a token
    (["xabc"], ["bc", "abc"], ("abc", "x")),  # both end at one character: the longer, cut earlier
    (["one ", "tw", "o three"], ["three", "two"], ("two", "one ")),  # across tokens
])
def test_the_first_stop_string_to_appear_in_full_ends_the_output(pieces, stop, want) -> None:
    assert run(pieces, stop) == want


def test_with_the_stop_string_kept_the_output_ends_after_it() -> None:
    assert run(["Say hello world"], ["world", "hello"], include=True) == ("hello", "Say hello")
    assert run(["xabc"], ["bc", "abc"], include=True) == ("abc", "xabc")
