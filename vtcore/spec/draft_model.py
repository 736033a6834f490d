"""The draft-model proposer: a smaller (or any) registered family proposes with its own engine.

The draft runs as a synchronous engine of its own, with its own KV cache and prefix caching on: each
step every verifying row becomes a draft request of the row's tokens, decoded greedily for k tokens,
all rows as one batch. Consecutive steps of one request share all but their last tokens, so the
draft's prefix cache holds its KV for them (only the tokens since the last full block are computed
again); a rejected proposal's blocks are simply never matched again. Greedy proposals keep the
target's distribution under the engine's acceptance rule at any temperature (a proposal is accepted
exactly when the target's own draw equals it).
"""
from __future__ import annotations

from typing import Any, Protocol, Sequence

from vtcore.sampling_params import SamplingParams


class DraftEngine(Protocol):
    """What the proposer needs of an LLMEngine."""

    def add_request(self, request_id: str, prompt: Any, params: SamplingParams) -> None: ...

    def step(self) -> list[Any]: ...

    def has_unfinished_requests(self) -> bool: ...


class DraftModelProposer:
    def __init__(self, engine: DraftEngine) -> None:
        self.engine = engine
        self.calls = 0

    def propose_batch(self, requests: Sequence[tuple[Sequence[int], int]]) -> list[list[int]]:
        """Each (tokens, k): the draft's greedy continuation of ``tokens``, ``k`` tokens."""
        self.calls += 1
        ids = [f"draft-{self.calls}-{i}" for i in range(len(requests))]
        for rid, (tokens, k) in zip(ids, requests):
            self.engine.add_request(rid, {"prompt_token_ids": list(tokens)},
                                    SamplingParams(temperature=0.0, max_tokens=k, ignore_eos=True))
        got: dict[str, list[int]] = {}
        while self.engine.has_unfinished_requests():
            for out in self.engine.step():
                if out.finished:
                    got[out.request_id] = list(out.outputs[0].token_ids)
        return [got[rid] for rid in ids]
