"""What the scheduler asks of a proposer."""
from __future__ import annotations

from typing import Protocol, Sequence


class Proposer(Protocol):
    def propose_batch(self, requests: Sequence[tuple[Sequence[int], int]]) -> list[list[int]]:
        """For each (tokens, k): up to ``k`` tokens likely to follow ``tokens`` (a request's prompt and
        outputs so far); [] for none. One call a step, for every row that may verify a draft, so a
        proposer with a model runs its rows as one batch."""
        ...


class PerSequence:
    """A proposer that looks at one sequence at a time: ``propose_batch`` maps its ``propose``."""

    def propose(self, tokens: Sequence[int], k: int) -> list[int]:
        raise NotImplementedError

    def propose_batch(self, requests: Sequence[tuple[Sequence[int], int]]) -> list[list[int]]:
        return [self.propose(tokens, k) for tokens, k in requests]
