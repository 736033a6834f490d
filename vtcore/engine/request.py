"""The engine's state of one request."""
from __future__ import annotations

import enum
import time
from typing import Any

import attrs

from vtcore.outputs import PositionLogprobs
from vtcore.sampling_params import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = enum.auto()
    RUNNING = enum.auto()
    DRAINING = enum.auto()  # its last token is in flight; it has left the scheduler
    FINISHED = enum.auto()


@attrs.define
class Verify:
    """A verify row of a request (speculative decoding) until the scheduler settles it: the step it was
    scheduled in, its draft tokens, how many were accepted (None until its step is applied) and whether a
    later share of the request floated over it (its positions and state shifted on the device by the
    accepted count, ``Scheduled.floats``)."""

    step: int
    drafts: int
    accepted: int | None = None
    floated: bool = False


class Request:
    """A prompt, its generated tokens, how far the KV cache has computed them and its blocks."""

    def __init__(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                 max_model_len: int, arrival: int, prompt: str | None = None) -> None:
        self.request_id = request_id
        self.prompt = prompt
        self.prompt_token_ids = list(prompt_token_ids)
        self.params = params
        self.arrival = arrival
        self.queued_ts = time.monotonic()  # when the engine took it (RequestMetrics'; time.monotonic's clock)
        self.scheduled_ts = 0.0  # when the scheduler first admitted it (0: not yet)
        self.first_token_ts = self.last_token_ts = 0.0  # when its first and latest output tokens reached the host
        self.priority = 0  # under the priority scheduling policy, lower values are served first
        self.token_ids = list(prompt_token_ids)  # prompt + output, the sequence the cache holds
        self.num_computed_tokens = 0  # advanced when a step is scheduled, not when it returns
        self.num_inflight = 0  # sampled tokens of scheduled steps whose values the host has not seen yet
        self.mirror_slot = -1  # this request's stable row in the runner's last_sampled_tokens while running
        self.block_ids: list[int] = []
        self.block_hashes: list[bytes] = []  # prefix-cache hashes of the first full blocks of token_ids
        self.cache_salt: str | None = None  # only requests of the same salt share cached blocks (vLLM's)
        self.num_registered_blocks = 0  # of block_ids, those the prefix cache can find
        self.num_cached_tokens = 0  # prompt tokens found in the prefix cache when first admitted
        self.restore_snapshot = -1  # the state snapshot its cached prefix resumes from (hybrid families)
        self.pending_snapshots: list[tuple[int, int]] = []  # (prefix length, snapshot slot) written, not registered
        self.status = RequestStatus.WAITING
        # The host knows this end without seeing token values: never schedule past it.
        budget = max_model_len - len(prompt_token_ids)
        self.max_output = budget if params.max_tokens is None else min(params.max_tokens, budget)
        self.finish_reason: str | None = None
        self.stop_reason: int | str | None = None
        self.logprobs: list[PositionLogprobs] | None = [] if params.logprobs is not None else None
        self.prompt_logprobs: list[PositionLogprobs | None] | None = None
        self.prompt_logprobs_scheduled = 1  # prompt positions whose logprobs a submitted step computes
        self.cumulative_logprob = 0.0
        self.generator: Any = None  # a per-request torch.Generator when params.seed is set
        self.grammar: Any = None  # its RequestGrammar when params.structured_outputs is set
        self.bad_words: tuple[tuple[int, ...], ...] = ()  # params.bad_words as token id spellings
        self.proposed: list[int] = []  # the draft the MTP head made in the step that sampled its last token
        self.drafted = False  # a share of it that samples was scheduled since it was admitted (its head drafted)
        self.verifies: list[Verify] = []  # its verify rows the scheduler has not settled yet
        self.detok: Any = None  # the incremental detokenizer, when the engine has a tokenizer
        self.num_preemptions = 0
        self.num_draft_tokens = self.num_accepted_tokens = 0  # speculative decoding, this request's
        self.resume_draft_state = -1  # its last verify row accepted this many of fewer draft tokens
        self.sent = (0, 0)  # (characters, tokens) already streamed, for DELTA outputs
        self.sent_prompt_logprobs = False  # a DELTA output carried them whole (later ones carry None)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[len(self.prompt_token_ids):]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def lag(self) -> int:
        """Accepted draft tokens of verify rows applied but not settled: the scheduler counts without them,
        so the sync engine (which applied them) decides as the async one (which has not) does."""
        return sum(v.accepted or 0 for v in self.verifies)

    @property
    def floats_over(self) -> int:
        """Draft tokens of the unsettled verify row a next share of it floats over (0: none); the scheduler
        settles every older one first."""
        return self.verifies[0].drafts if self.verifies else 0

    @property
    def num_tokens_scheduled(self) -> int:
        """Tokens the sequence will hold once every in-flight token lands (an unsettled verify row's
        accepted draft tokens not counted: ``lag``)."""
        return len(self.token_ids) + self.num_inflight - (self.lag if self.verifies else 0)

    @property
    def num_outputs_scheduled(self) -> int:
        """Output tokens counted as ``num_tokens_scheduled`` counts tokens: at least this many will exist."""
        return self.num_tokens_scheduled - len(self.prompt_token_ids)

    @property
    def host_knows_end(self) -> bool:
        """True once the in-flight tokens reach max_tokens or the context end (the scheduler also waits for
        every known token to be computed: max_tokens=0 with prompt_logprobs needs every prefill chunk)."""
        return self.num_outputs_scheduled >= self.max_output

    @property
    def is_finished(self) -> bool:
        return self.status == RequestStatus.FINISHED
