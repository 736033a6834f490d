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
    """Per-request counters, speculative decoding's proposed and accepted tokens (0 without it), and vLLM V1's
    engine timestamps: ``queued_ts``, when the engine took the request, ``scheduled_ts``, when the scheduler
    first admitted it, ``first_token_ts`` and ``last_token_ts``, when its first and latest output tokens reached
    the engine's host (0.0: not yet), in ``time.monotonic()``'s seconds (the system's monotonic clock, shared
    by the engine core process and the front end)."""

    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    queued_ts: float = attrs.field(default=0.0, eq=False)  # (times, not content: two equal outputs may differ)
    scheduled_ts: float = attrs.field(default=0.0, eq=False)
    first_token_ts: float = attrs.field(default=0.0, eq=False)
    last_token_ts: float = attrs.field(default=0.0, eq=False)

    @property
    def first_token_latency(self) -> float:
        """Seconds from the engine taking the request to its first output token (0.0: none yet)."""
        return self.first_token_ts - self.queued_ts if self.first_token_ts else 0.0


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

    def add(self, later: RequestOutput, aggregate: bool) -> None:
        """Merge ``later`` (this request's next output) into this one, as vLLM's ``RequestOutput.add``: with
        ``aggregate`` (delta outputs) each completion's new tokens, text and logprobs are appended to it, else
        (cumulative outputs) a completion is replaced by its later state; the request's state is ``later``'s, and
        so are its prompt logprobs where it has them (a cumulative output's grow over a chunked prompt; deltas
        carry them once). A delta's lists are its own, so they are extended in place."""
        self.finished = self.finished or later.finished
        self.num_cached_tokens, self.metrics = later.num_cached_tokens, later.metrics
        if later.prompt_logprobs is not None:
            self.prompt_logprobs = later.prompt_logprobs
        at = {c.index: i for i, c in enumerate(self.outputs)}
        for nxt in later.outputs:
            if nxt.index not in at:
                self.outputs.append(nxt)
            elif not aggregate:
                self.outputs[at[nxt.index]] = nxt
            else:
                cur = self.outputs[at[nxt.index]]
                cur.text += nxt.text
                cur.token_ids.extend(nxt.token_ids)
                if nxt.logprobs is not None:
                    if cur.logprobs is None:
                        cur.logprobs = []
                    cur.logprobs.extend(nxt.logprobs)
                cur.cumulative_logprob = nxt.cumulative_logprob
                cur.finish_reason, cur.stop_reason = nxt.finish_reason, nxt.stop_reason
