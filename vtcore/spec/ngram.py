"""The n-gram proposer (prompt lookup decoding): no model, only the request's own tokens.

For n from ``max_n`` down to ``min_n``, the last n tokens are looked up in the sequence before them;
at the latest earlier occurrence, the tokens that followed it are the proposal. Repetitive text
(code, quoted context, lists) makes long accepted runs; a miss proposes nothing. The search runs
in numpy, narrowing the positions of the last token by one earlier token at a time: it sits on the step's critical path, once a row a step, and a
Python scan over a few thousand tokens costs milliseconds a row.
"""
from __future__ import annotations

from typing import Sequence

import numpy as np

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
        if size - 1 < self.min_n:
            return []
        a = np.asarray(tokens, dtype=np.int64)
        top = min(self.max_n, size - 1)
        ends = np.flatnonzero(a[:size - 1] == a[size - 1])  # where a match's last token can sit
        # matched[j]: the ends whose j + 1 tokens up to them equal the last j + 1 tokens
        matched = [ends]
        for j in range(1, top):
            e = matched[-1]
            e = e[e >= j]
            matched.append(e[a[e - j] == a[size - 1 - j]])
        for n in range(top, self.min_n - 1, -1):
            if matched[n - 1].size:
                start = int(matched[n - 1][-1]) - n + 1
                return a[start + n:start + n + k].tolist()
        return []
