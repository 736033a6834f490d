"""What an engine reports about itself: its fixed limits and its load (``LLMEngine.limits``, ``stats``)."""
from __future__ import annotations

import bisect

import attrs

#: upper bounds of the tokens-per-step histogram (vLLM's ``iteration_tokens_total`` buckets of an engine without CUDA
#: graph sizes; a last bucket, +Inf, above them)
ITERATION_TOKEN_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)


@attrs.frozen
class EngineLimits:
    """The engine's fixed limits: a request beyond them is refused at ``add_request``."""

    max_model_len: int  # prompt + output tokens of one request
    vocab_size: int  # token ids are in [0, vocab_size)
    max_num_seqs: int  # requests running at once
    max_num_batched_tokens: int  # tokens one step computes
    block_size: int  # tokens a KV block holds
    num_kv_blocks: int  # KV blocks in the pool, shared by every running request
    by_priority: bool = False  # scheduling_policy="priority": requests may carry a priority other than 0
    max_logprobs: int = -1  # the most alternatives a request's logprobs may ask for (-1: no cap)

    def kv_blocks_needed(self, num_tokens: int) -> int:
        """KV blocks a request of ``num_tokens`` tokens (prompt + output) holds at its longest."""
        return -(-num_tokens // self.block_size)


@attrs.frozen
class EngineStats:
    """A snapshot of the engine's load, for metrics (read from any thread)."""

    num_running: int  # requests the scheduler is running
    num_waiting: int  # requests queued to be scheduled (preempted ones included)
    kv_cache_usage: float  # fraction of the KV blocks in use, 0 to 1
    num_preemptions: int  # preemptions since the engine started (a counter)
    prefix_cache_queries: int = 0  # prompt tokens looked up in the prefix cache (a counter)
    prefix_cache_hits: int = 0  # of those, tokens found (a counter)
    spec_decode_num_drafts: int = 0  # speculative decoding: verify rows (a counter)
    spec_decode_num_draft_tokens: int = 0  # tokens proposed (a counter)
    spec_decode_num_accepted_tokens: int = 0  # of those, accepted (a counter)
    spec_decode_accepted_per_position: tuple[int, ...] = ()  # drafts whose i-th token was accepted (counters)
    #: steps by the tokens they computed: a counter per bucket of ``ITERATION_TOKEN_BUCKETS`` and one above them
    iteration_tokens: tuple[int, ...] = ()
    iteration_tokens_sum: int = 0  # tokens computed by every step so far (a counter)


class Buckets:
    """Counts of values by the first upper bound each is at most (Prometheus' ``le``; a last count above every
    bound), their sum and number: a histogram's state, the server's (``vtcore.server.metrics.Histogram``) and the
    engine's tokens per step (``EngineStats.iteration_tokens``)."""

    def __init__(self, bounds: tuple[float, ...] = ITERATION_TOKEN_BUCKETS) -> None:
        self.buckets = tuple(sorted(bounds))
        self.counts = [0] * (len(self.buckets) + 1)
        self.sum: float = 0
        self.count = 0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.buckets, value)] += 1
        self.sum += value
        self.count += 1
