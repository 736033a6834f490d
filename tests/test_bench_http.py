"""``vtcore bench --base-url``: the closed loop over OpenAI streaming HTTP, against vtcore's own server
on the embedded default model (no performance thresholds: the counts and the statistics' shape)."""
from __future__ import annotations

import io
import json
from typing import Any

import pytest
from server_harness import ServerThread, engine, needs_default_model, server  # noqa: F401

from vtcore.cli.main import main

pytestmark = needs_default_model


def test_the_http_bench_counts_every_token_and_request(server: ServerThread, tmp_path: Any) -> None:  # noqa: F811
    path = tmp_path / "http.json"
    out = io.StringIO()
    rc = main(["bench", "--base-url", f"{server.url}/v1", "--concurrency", "1,3", "--num-prompts", "3",
               "--input-len", "12", "--output-len", "6", "--json", str(path)], out=out)
    assert rc == 0, out.getvalue()
    doc = json.loads(path.read_text())
    assert doc["mode"] == "http" and doc["model"] == "vtcore-test"
    for r, c in zip(doc["runs"], (1, 3)):
        assert (r["concurrency"], r["num_prompts"]) == (c, 3)
        assert r["output_tokens"] == 3 * 6 and r["prompt_tokens"] == 3 * 12  # usage, and ignore_eos honoured
        assert r["ttft_s"]["count"] == 3 and r["tpot_s"]["count"] == 3 and r["finish_reasons"] == ["length"]
        assert 0 < r["ttft_s"]["median"] <= r["latency_s"]["median"]
        assert r["output_throughput_tok_s"] == pytest.approx(r["output_tokens"] / r["wall_s"])
    assert "served: " in out.getvalue() and "    3     3" in out.getvalue()


def test_engine_only_flags_are_refused_with_a_base_url(capsys: Any) -> None:
    assert main(["bench", "--base-url", "http://127.0.0.1:9/v1", "--compare-prefix-caching"], out=io.StringIO()) == 2
    assert "--base-url measures a server as it runs; --compare-prefix-caching needs" in capsys.readouterr().err


def test_an_unreachable_server_is_an_error_naming_it(capsys: Any) -> None:
    rc = main(["bench", "--base-url", "http://127.0.0.1:9/v1", "--concurrency", "1", "--input-len", "4",
               "--output-len", "2"], out=io.StringIO())
    err = capsys.readouterr().err
    assert rc == 2 and "--base-url http://127.0.0.1:9/v1: GET /models failed" in err and "Traceback" not in err
