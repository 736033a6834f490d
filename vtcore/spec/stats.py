"""Speculative decoding counters, as vLLM reports them (since the engine started)."""
from __future__ import annotations


class SpecDecodeStats:
    """``num_drafts``: verify rows; ``num_draft_tokens``: tokens proposed; ``num_accepted_tokens``: of
    those, accepted; ``accepted_per_position[i]``: drafts whose token ``i`` (from 0) was accepted."""

    def __init__(self, k: int) -> None:
        self.num_drafts = self.num_draft_tokens = self.num_accepted_tokens = 0
        self.accepted_per_position = [0] * k

    def record(self, proposed: int, accepted: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += proposed
        self.num_accepted_tokens += accepted
        for i in range(accepted):
            self.accepted_per_position[i] += 1

    @property
    def acceptance_rate(self) -> float | None:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else None

    @property
    def mean_acceptance_length(self) -> float | None:
        """Tokens a verify row emits on average: the accepted ones and the one it samples anyway."""
        return 1 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else None
