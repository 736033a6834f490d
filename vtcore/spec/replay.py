"""The replay proposer: proposes continuations recorded from an earlier run, for tests and benchmarks.

Dummy weights accept nothing an n-gram proposes, and a gate needs accepted runs of every length. Given
the full token sequences of an earlier greedy run (prompt and output), it proposes what followed a
request's tokens there; with ``reject_every`` it replaces one proposed token by another so that the
accepted run's length cycles through 0..k-1 and k (all accepted) as the sequence grows. Sequences
are looked up by their first ``KEY_TOKENS`` tokens, so a benchmark's step pays for its own rows only.
"""
from __future__ import annotations

from collections import defaultdict
from typing import Sequence

from vtcore.spec.proposer import PerSequence

KEY_TOKENS = 8


class ReplayProposer(PerSequence):
    def __init__(self, sequences: Sequence[Sequence[int]], vocab_size: int, reject_every: bool = False) -> None:
        self.sequences = [list(s) for s in sequences]
        self.by_start: dict[tuple[int, ...], list[list[int]]] = defaultdict(list)
        for s in self.sequences:
            self.by_start[tuple(s[:KEY_TOKENS])].append(s)
        self.vocab_size = vocab_size
        self.reject_every = reject_every

    def propose(self, tokens: Sequence[int], k: int) -> list[int]:
        """What followed ``tokens`` in the recorded sequence they begin (up to ``k`` tokens), with one
        of them changed when ``reject_every`` (the position cycles with the length of ``tokens``)."""
        n = len(tokens)
        candidates = self.by_start.get(tuple(tokens[:KEY_TOKENS]), ()) if n >= KEY_TOKENS else self.sequences
        for seq in candidates:
            if len(seq) > n and seq[:n] == list(tokens):
                draft = seq[n:n + k]
                wrong = n % (k + 1)  # k: none changed
                if self.reject_every and wrong < len(draft):
                    draft[wrong] = (draft[wrong] + 1) % self.vocab_size
                return draft
        return []
