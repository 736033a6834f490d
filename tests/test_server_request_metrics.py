"""vLLM's per-request metrics: the engine's timestamps (``RequestMetrics.queued_ts``, ``scheduled_ts``) and the
server's histograms built on them (queue, prefill, decode and inference time), with the per-request token counts
and parameters (``request_prompt_tokens``, ``request_generation_tokens``, ``request_params_n``,
``request_params_max_tokens``)."""
from __future__ import annotations

import time

import pytest
from server_harness import MODEL, ServerThread, engine, httpx, metric, needs_default_model  # noqa: F401

from vtcore import LLM, AsyncLLM, SamplingParams
from vtcore.outputs import RequestMetrics
from vtcore.server.app import build_app
from vtcore.server.metrics import ServerMetrics, one_two_five

pytestmark = needs_default_model
PHASES = ("queue", "prefill", "decode", "inference")


def test_the_engine_stamps_when_a_request_is_queued_and_first_scheduled() -> None:
    """With one sequence at a time, the second prompt waits for the first: its queue time is longer, and it is
    scheduled after the first was."""
    llm = LLM(device="cpu", num_kv_blocks=32, max_num_seqs=1)
    before = time.monotonic()
    first, second = llm.generate([{"prompt_token_ids": [5, 6, 7]}, {"prompt_token_ids": [8, 9]}],
                                 SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))
    after = time.monotonic()
    for out in (first, second):
        m = out.metrics  # (vLLM V1's first and last token stamps too: a ported TTFT script reads them)
        assert before <= m.queued_ts <= m.scheduled_ts < m.first_token_ts < m.last_token_ts <= after
        assert m.first_token_latency == m.first_token_ts - m.queued_ts
    assert second.metrics.scheduled_ts > first.metrics.scheduled_ts
    assert second.metrics.first_token_ts > first.metrics.last_token_ts  # (one sequence at a time)
    waited = [o.metrics.scheduled_ts - o.metrics.queued_ts for o in (first, second)]
    assert waited[1] > waited[0]
    fanned = llm.generate({"prompt_token_ids": [5, 6]}, SamplingParams(n=2, max_tokens=2, seed=1))[0]
    m = fanned.metrics
    assert 0 < m.queued_ts <= m.scheduled_ts < m.first_token_ts <= m.last_token_ts <= time.monotonic()


def test_phases_split_a_requests_time_at_the_engines_timestamps() -> None:
    m = ServerMetrics("m", lambda: None, max_model_len=1024)
    m.finished("length", 4, arrival=0.5, first_token=2.0, end=3.5, prompt_tokens=12, max_tokens=4,
               engine=RequestMetrics(queued_ts=1.0, scheduled_ts=1.25))
    m.prompt_finished(2)
    assert [getattr(m, p).sum for p in PHASES] == [0.25, 0.75, 1.5, 2.25]
    m.finished("abort", 0, arrival=0.5, first_token=None, end=1.0, engine=RequestMetrics(queued_ts=0.6))
    assert [getattr(m, p).count for p in PHASES] == [1, 1, 1, 1]  # (never scheduled, no token: no phase)
    assert (m.request_prompt_tokens.sum, m.request_generation_tokens.sum, m.params_n.sum,
            m.params_max_tokens.count) == (12, 4, 2, 1)
    assert m.request_prompt_tokens.buckets == one_two_five(1024) == (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000)
    text = m.render()
    assert 'vtcore:request_prompt_tokens_bucket{model_name="m",le="20.0"} 2.0' in text
    assert "# TYPE vtcore:request_queue_time_seconds histogram" in text


def test_a_served_requests_phases_and_counts_reach_metrics(engine: AsyncLLM) -> None:  # noqa: F811
    with ServerThread(build_app(engine, MODEL)) as srv:
        def scrape() -> dict[str, float]:
            text = httpx.get(srv.url + "/metrics").text
            names = [f"request_{p}_time_seconds" for p in PHASES] + [
                "e2e_request_latency_seconds", "request_prompt_tokens", "request_generation_tokens",
                "request_params_n", "request_params_max_tokens"]
            return {f"{n}_{part}": metric(text, f"vtcore:{n}_{part}") for n in names for part in ("sum", "count")}

        before = scrape()
        body = {"model": MODEL, "prompt": [5, 6, 7, 8, 9], "max_tokens": 4, "ignore_eos": True, "n": 2, "seed": 3}
        assert httpx.post(srv.url + "/v1/completions", json=body, timeout=60).status_code == 200
        got = {k: v - before[k] for k, v in scrape().items()}
    assert all(got[f"request_{p}_time_seconds_count"] == 2 for p in PHASES), got
    assert got["request_inference_time_seconds_sum"] == pytest.approx(
        got["request_prefill_time_seconds_sum"] + got["request_decode_time_seconds_sum"], abs=1e-9)
    assert 0 < got["request_inference_time_seconds_sum"] <= got["e2e_request_latency_seconds_sum"]
    assert (got["request_prompt_tokens_sum"], got["request_generation_tokens_sum"], got["request_params_n_sum"],
            got["request_params_max_tokens_sum"]) == (10, 8, 2, 8)  # (n: once a prompt, as vLLM's)
