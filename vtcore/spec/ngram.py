"""The n-gram proposer (prompt lookup decoding): no model, only the request's own tokens.

For n from ``max_n`` down to ``min_n``, the last n tokens are looked up in the sequence before them;
at the latest earlier occurrence, the tokens that followed it are the proposal. Repetitive text
(code, quoted context, lists) makes long accepted runs; a miss proposes nothing.
"""
from __future__ import annotations

from typing import Sequence

from vtcore.spec.proposer import PerSequence


class NgramProposer(PerSequence):
    def __init__(self, min_n: int, max_n: int) -> None:
        self.min_n, self.max_n = min_n, max_n

    def propose(self, tokens: Sequence[int], k: int) -> list[int]:
        """Up to ``k`` tokens to follow ``tokens``: what followed the latest earlier occurrence of their
        longest matching suffix (``min_n`` to ``max_n`` tokens), or [] when none occurs."""
        if k <= 0:
            return []
        size = len(tokens)
        for n in range(min(self.max_n, size - 1), self.min_n - 1, -1):
            suffix = list(tokens[size - n:])
            for start in range(size - n - 1, -1, -1):
                if list(tokens[start:start + n]) == suffix:
                    return list(tokens[start + n:start + n + k])
        return []
