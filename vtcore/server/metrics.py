"""Prometheus metrics of the server, in the text exposition format (0.0.4), written by hand.

Names follow vLLM's (``vtcore:`` instead of ``vllm:``) so dashboards carry over. Counters and
histograms are updated from the server's event loop; the engine's load (``EngineStats``) is read
once a scrape.
"""
from __future__ import annotations

import threading
from typing import Callable, Literal, Sequence

from vtcore.engine.capacity import ITERATION_TOKEN_BUCKETS, Buckets, EngineStats
from vtcore.outputs import RequestMetrics

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0)
TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5,
                5.0, 10.0)
E2E_BUCKETS = (0.01, 0.05, 0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0,
               60.0, 120.0, 240.0)


#: request parameters' buckets (vLLM's): n, and 1-2-5 steps up to the context for token counts
N_BUCKETS = (1, 2, 5, 10, 20)


def one_two_five(limit: int) -> tuple[int, ...]:
    """1, 2, 5, 10, 20, 50, ... up to ``limit`` (vLLM's ``build_1_2_5_buckets``)."""
    out, scale = [], 1
    while True:
        for step in (1, 2, 5):
            if step * scale > limit:
                return tuple(out)
            out.append(step * scale)
        scale *= 10


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _labels(labels: dict[str, str]) -> str:
    if not labels:
        return ""
    return "{" + ",".join(f'{k}="{_escape(str(v))}"' for k, v in labels.items()) + "}"


def _num(value: float) -> str:
    if value == float("inf"):
        return "+Inf"
    if value == float("-inf"):
        return "-Inf"
    if value != value:
        return "NaN"
    return repr(float(value)) if not float(value).is_integer() else f"{float(value):.1f}"


#: the engine's finish reasons of a choice ("abort": the client left, or the server stopped it)
FINISH_REASONS = ("stop", "length", "abort")


class Counter:
    def __init__(self, name: str, help: str) -> None:
        assert name.endswith("_total")
        self.name, self.help = name, help
        self.values: dict[tuple[tuple[str, str], ...], float] = {}

    def inc(self, amount: float = 1.0, **labels: str) -> None:
        key = tuple(sorted(labels.items()))
        self.values[key] = self.values.get(key, 0.0) + amount

    def get(self, **labels: str) -> float:
        return self.values.get(tuple(sorted(labels.items())), 0.0)

    def render(self, base: dict[str, str]) -> list[str]:
        lines = [f"# HELP {self.name} {self.help}", f"# TYPE {self.name} counter"]
        for key, value in sorted(self.values.items()):
            lines.append(f"{self.name}{_labels({**base, **dict(key)})} {_num(value)}")
        if not self.values and not base:
            lines.append(f"{self.name} 0.0")
        elif not self.values:
            lines.append(f"{self.name}{_labels(base)} 0.0")
        return lines


class Histogram(Buckets):
    def __init__(self, name: str, help: str, buckets: tuple[float, ...]) -> None:
        super().__init__(buckets)
        self.name, self.help = name, help

    def render(self, base: dict[str, str]) -> list[str]:
        return _histogram_lines(self.name, self.help, base, self.buckets, self.counts, self.sum)


def _histogram_lines(name: str, help: str, base: dict[str, str], buckets: tuple[float, ...],
                     counts: Sequence[int], total: float) -> list[str]:
    """A histogram's exposition from its count per bucket (``buckets``' upper bounds, then +Inf)."""
    lines = [f"# HELP {name} {help}", f"# TYPE {name} histogram"]
    running = 0
    for bound, n in zip((*buckets, float("inf")), counts):
        running += n
        lines.append(f"{name}_bucket{_labels({**base, 'le': _num(bound)})} {_num(running)}")
    lines.append(f"{name}_sum{_labels(base)} {_num(total)}")
    lines.append(f"{name}_count{_labels(base)} {_num(running)}")
    return lines


class Reading:
    """A value read from the engine's stats at scrape time: a gauge, or a counter the engine keeps."""

    def __init__(self, name: str, kind: Literal["gauge", "counter"], help: str,
                 read: Callable[[EngineStats], float]) -> None:
        self.name, self.kind, self.help, self.read = name, kind, help, read

    def render(self, base: dict[str, str], stats: EngineStats | None) -> list[str]:
        value = float("nan") if stats is None else float(self.read(stats))
        return [f"# HELP {self.name} {self.help}", f"# TYPE {self.name} {self.kind}",
                f"{self.name}{_labels(base)} {_num(value)}"]


class StepTokensReading:
    """The engine's tokens-per-step histogram (``EngineStats.iteration_tokens``), read at scrape time. vLLM's name;
    its count differs under chunked prefill, speculation and preemption, where vLLM counts a prompt once (at its first
    token) and accepted tokens only: this one counts what each step computed, so its count is the engine's steps."""

    name = "vtcore:iteration_tokens_total"
    help = "Tokens computed by each engine step: prompt chunks, fed-back outputs and drafts (vLLM's name)."

    def render(self, base: dict[str, str], stats: EngineStats | None) -> list[str]:
        counts = stats.iteration_tokens if stats is not None and stats.iteration_tokens else ()
        return _histogram_lines(self.name, self.help, base, ITERATION_TOKEN_BUCKETS,
                                counts or (0,) * (len(ITERATION_TOKEN_BUCKETS) + 1),
                                stats.iteration_tokens_sum if counts else 0)


class PositionReadings(Reading):
    """A counter per draft position (label ``position``) read from one tuple of the engine's stats."""

    def render(self, base: dict[str, str], stats: EngineStats | None) -> list[str]:
        lines = [f"# HELP {self.name} {self.help}", f"# TYPE {self.name} {self.kind}"]
        for position, value in enumerate(() if stats is None else self.read(stats)):
            lines.append(f"{self.name}{_labels({**base, 'position': str(position)})} {_num(float(value))}")
        return lines


class ServerMetrics:
    """Every metric the server exports; ``render()`` is the /metrics body."""

    def __init__(self, model_name: str, stats: Callable[[], EngineStats], max_model_len: int = 1 << 20) -> None:
        self.base = {"model_name": model_name}
        self._lock = threading.Lock()
        self.stats = stats
        self.http_requests = Counter("vtcore:http_requests_total", "HTTP requests answered, by endpoint and status.")
        self.requests = Counter("vtcore:request_success_total",
                                "Generation requests (one per prompt and choice) finished, by finish reason.")
        for reason in FINISH_REASONS:  # (every series from the start, at 0, as vLLM's: a rate() sees the first)
            self.requests.inc(0.0, finished_reason=reason)
        # (as vLLM's, counted as they come: a request's prompt with its first output, each token as it reaches the
        # server; a rate() of them is the throughput while requests run, not only once they end)
        self.prompt_tokens = Counter("vtcore:prompt_tokens_total",
                                     "Prompt tokens of the requests (one per choice) that have had a first output.")
        self.generation_tokens = Counter("vtcore:generation_tokens_total", "Tokens generated.")
        self.ttft = Histogram("vtcore:time_to_first_token_seconds",
                              "Time from a request's arrival to its first generated token.", TTFT_BUCKETS)
        # (vLLM's: one sample an output after a request's first, the time since its previous one; and the
        # per-request mean apart)
        self.itl = Histogram("vtcore:inter_token_latency_seconds",
                             "Time between a request's outputs with tokens, one sample each after the first.",
                             TPOT_BUCKETS)
        self.tpot = Histogram("vtcore:time_per_output_token_seconds",
                              "vLLM's older name of inter_token_latency_seconds: the same samples.", TPOT_BUCKETS)
        self.request_tpot = Histogram("vtcore:request_time_per_output_token_seconds",
                                      "Mean time between a request's generated tokens after the first.", TPOT_BUCKETS)
        self.e2e = Histogram("vtcore:e2e_request_latency_seconds", "Time from a request's arrival to its end.",
                             E2E_BUCKETS)
        # (vLLM's phases from the engine's timestamps: queued (taken) -> scheduled (first admitted) -> first token
        # -> last token, the tokens' times as they reach the server; the same buckets as the end-to-end latency)
        self.queue = Histogram("vtcore:request_queue_time_seconds",
                               "Time a request waited in the engine before it was first scheduled.", E2E_BUCKETS)
        self.prefill = Histogram("vtcore:request_prefill_time_seconds",
                                 "Time from a request's first scheduling to its first token.", E2E_BUCKETS)
        self.decode = Histogram("vtcore:request_decode_time_seconds",
                                "Time from a request's first token to its last.", E2E_BUCKETS)
        self.inference = Histogram("vtcore:request_inference_time_seconds",
                                   "Time from a request's first scheduling to its last token.", E2E_BUCKETS)
        tokens = one_two_five(max_model_len)
        self.request_prompt_tokens = Histogram("vtcore:request_prompt_tokens",
                                               "Prompt tokens of each finished request.", tokens)
        self.request_generation_tokens = Histogram("vtcore:request_generation_tokens",
                                                   "Tokens generated by each finished request.", tokens)
        self.params_n = Histogram("vtcore:request_params_n", "The n parameter of each finished prompt (once for its "
                                  "n choices).", N_BUCKETS)
        self.params_max_tokens = Histogram("vtcore:request_params_max_tokens",
                                           "The max_tokens parameter of each finished request that set it.", tokens)
        self.readings = [
            Reading("vtcore:kv_cache_usage_perc", "gauge", "Fraction of KV-cache blocks in use (1 = full).",
                    lambda s: s.kv_cache_usage),
            Reading("vtcore:num_requests_running", "gauge", "Requests the scheduler is running.",
                    lambda s: s.num_running),
            Reading("vtcore:num_requests_waiting", "gauge", "Requests waiting to be scheduled.",
                    lambda s: s.num_waiting),
            Reading("vtcore:num_preemptions_total", "counter", "Requests preempted (to be recomputed) so far.",
                    lambda s: s.num_preemptions),
            Reading("vtcore:prefix_cache_queries_total", "counter",
                    "Prompt tokens looked up in the prefix cache.", lambda s: s.prefix_cache_queries),
            Reading("vtcore:prefix_cache_hits_total", "counter",
                    "Prompt tokens found in the prefix cache.", lambda s: s.prefix_cache_hits),
            Reading("vtcore:spec_decode_num_drafts_total", "counter",
                    "Speculative decoding: verify rows (one per request and step).", lambda s: s.spec_decode_num_drafts),
            Reading("vtcore:spec_decode_num_draft_tokens_total", "counter",
                    "Speculative decoding: tokens proposed.", lambda s: s.spec_decode_num_draft_tokens),
            Reading("vtcore:spec_decode_num_accepted_tokens_total", "counter",
                    "Speculative decoding: proposed tokens accepted.", lambda s: s.spec_decode_num_accepted_tokens),
            PositionReadings("vtcore:spec_decode_num_accepted_tokens_per_pos", "counter",
                             "Speculative decoding: drafts whose token at this position was accepted.",
                             lambda s: s.spec_decode_accepted_per_position),
            StepTokensReading(),
        ]

    def http(self, endpoint: str, status: int) -> None:
        with self._lock:
            self.http_requests.inc(endpoint=endpoint, status=str(status))

    def tokens(self, prompt_tokens: int, generation_tokens: int, gap: float | None) -> None:
        """Count tokens as they reach the server: a choice's prompt with its first output, then each token;
        ``gap``: the seconds since the choice's previous output with tokens (None: none before)."""
        with self._lock:
            self.prompt_tokens.inc(prompt_tokens)
            self.generation_tokens.inc(generation_tokens)
            if gap is not None:
                self.itl.observe(max(gap, 0.0))
                self.tpot.observe(max(gap, 0.0))

    def finished(self, reason: str, generation_tokens: int, arrival: float, first_token: float | None,
                 end: float, *, prompt_tokens: int = 0, max_tokens: int | None = None,
                 engine: RequestMetrics | None = None) -> None:
        """Record one finished generation request (one choice; times from ``time.monotonic``, ``engine``'s
        timestamps included): its latencies, its phases where the engine's timestamps say when it was scheduled
        (the prompt's first sample's, for every choice of an n > 1 prompt), its token counts and max_tokens."""
        scheduled = engine.scheduled_ts if engine is not None else 0.0
        with self._lock:
            self.requests.inc(finished_reason=reason or "unknown")
            self.e2e.observe(max(end - arrival, 0.0))
            if first_token is not None:
                decode = max(end - first_token, 0.0)
                self.ttft.observe(max(first_token - arrival, 0.0))
                self.decode.observe(decode)
                if generation_tokens > 1:
                    self.request_tpot.observe(decode / (generation_tokens - 1))
            if scheduled:  # (a request aborted before it was scheduled has no phases)
                self.queue.observe(max(scheduled - engine.queued_ts, 0.0))
                self.inference.observe(max(end - scheduled, 0.0))
                if first_token is not None:
                    self.prefill.observe(max(first_token - scheduled, 0.0))
            self.request_prompt_tokens.observe(prompt_tokens)
            self.request_generation_tokens.observe(generation_tokens)
            if max_tokens is not None:
                self.params_max_tokens.observe(max_tokens)

    def prompt_finished(self, n: int) -> None:
        """Record a prompt's every choice finished: its ``n`` (vLLM's, once a parent request)."""
        with self._lock:
            self.params_n.observe(n)

    def render(self) -> str:
        lines: list[str] = []
        with self._lock:
            for c in (self.http_requests, self.requests, self.prompt_tokens, self.generation_tokens):
                lines += c.render(self.base)
            for h in (self.ttft, self.itl, self.tpot, self.request_tpot, self.e2e, self.queue, self.prefill,
                      self.decode, self.inference, self.request_prompt_tokens, self.request_generation_tokens,
                      self.params_n, self.params_max_tokens):
                lines += h.render(self.base)
        try:
            stats: EngineStats | None = self.stats()
        except Exception:  # noqa: BLE001 - a scrape must not fail because the engine is gone
            stats = None
        for reading in self.readings:
            lines += reading.render(self.base, stats)
        return "\n".join(lines) + "\n"
