"""What the scheduler asks of a proposer."""
from __future__ import annotations

from typing import Protocol, Sequence


class Proposer(Protocol):
    def propose(self, tokens: Sequence[int], k: int) -> list[int]:
        """Up to ``k`` tokens likely to follow ``tokens`` (a request's prompt and outputs so far); [] for none."""
        ...
