"""What the engines return: ``RequestOutput`` and its ``CompletionOutput`` (vLLM's shapes)."""
from __future__ import annotations

import attrs


@attrs.define
class Logprob:
    """The log-probability of one token, its rank in the distribution and its decoded text."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


#: One position's logprobs: token id -> Logprob (the sampled or prompt token, then the top k).
PositionLogprobs = dict[int, Logprob]


@attrs.define
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: list[PositionLogprobs] | None
    finish_reason: str | None = None  # "stop", "length", "abort" or None while running
    stop_reason: int | str | None = None  # the stop string or stop token id that ended it

    def finished(self) -> bool:
        return self.finish_reason is not None


@attrs.define
class RequestMetrics:
    """Per-request counters: speculative decoding's proposed and accepted tokens (0 without it)."""

    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0


@attrs.define
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    prompt_logprobs: list[PositionLogprobs | None] | None
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int = 0  # prompt tokens whose KV came from the prefix cache
    metrics: RequestMetrics = attrs.Factory(RequestMetrics)
