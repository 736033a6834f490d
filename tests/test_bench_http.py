"""``vtcore bench --base-url``: the closed loop over OpenAI streaming HTTP, against vtcore's own server
on the embedded default model (no performance thresholds: the counts and the statistics' shape)."""
from __future__ import annotations

import io
import json
from typing import Any, Callable

import pytest
from server_harness import ServerThread, engine, needs_default_model, server  # noqa: F401

from vtcore import AsyncLLM
from vtcore.bench.structured_share import bench_schema
from vtcore.cli.main import main
from vtcore.structured import StructuredOutputsParams

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


def test_client_processes_share_the_streams_and_merge_every_request(server: ServerThread,  # noqa: F811
                                                                      tmp_path: Any) -> None:
    path = tmp_path / "http.json"
    rc = main(["bench", "--base-url", f"{server.url}/v1", "--concurrency", "3", "--num-prompts", "5",
               "--input-len", "7", "--output-len", "4", "--client-processes", "2", "--json", str(path)],
              out=io.StringIO())
    assert rc == 0
    (r,) = json.loads(path.read_text())["runs"]
    assert r["client_processes"] == 2 and r["num_prompts"] == 5
    assert r["output_tokens"] == 5 * 4 and r["prompt_tokens"] == 5 * 7  # 3 prompts in one process, 2 in the other
    assert r["ttft_s"]["count"] == 5 and r["latency_s"]["count"] == 5
    assert r["wall_s"] >= r["latency_s"]["p99"]  # one window over both processes


def test_a_structured_share_is_sent_as_vllms_field_and_reported_apart(server: ServerThread,  # noqa: F811
                                                                      engine: AsyncLLM, tmp_path: Any) -> None:  # noqa: F811
    """--structured-share over HTTP: that share of the requests (interleaved) carry ``structured_outputs`` with
    the bench's schema, which the server compiles (its grammar cache holds it after, not before); the groups
    are reported apart, adding up to the run."""
    held = StructuredOutputsParams(json=bench_schema(37))
    assert not engine.engine.grammar_compiled(held)
    path, out = tmp_path / "http.json", io.StringIO()
    rc = main(["bench", "--base-url", f"{server.url}/v1", "--concurrency", "2", "--num-prompts", "4",
               "--input-len", "5", "--output-len", "37", "--structured-share", "0.5", "--json", str(path)], out=out)
    assert rc == 0, out.getvalue()
    assert engine.engine.grammar_compiled(held)
    (r,) = json.loads(path.read_text())["runs"]
    groups = r["groups"]
    assert r["structured_share"] == 0.5
    assert groups["constrained"]["requests"] == groups["unconstrained"]["requests"] == 2
    assert groups["constrained"]["output_tokens"] == groups["unconstrained"]["output_tokens"] == 2 * 37
    assert groups["constrained"]["finish_reasons"] == ["length"]
    assert "c=2 constrained: 2 requests" in out.getvalue() and "c=2 unconstrained: 2 requests" in out.getvalue()
    assert main(["bench", "--base-url", f"{server.url}/v1", "--structured-share", "2"], out=io.StringIO()) == 2


@pytest.mark.parametrize("cores", [2, 6, 16, 64])
def test_client_processes_default_to_one_per_8_streams_leaving_cores_to_the_server(monkeypatch, cores) -> None:
    from vtcore.bench import http

    monkeypatch.setattr(http.os, "cpu_count", lambda: cores)
    spare = max(1, cores - http.SERVER_CORES)
    assert http.client_processes(1) == 1 and http.client_processes(8) == 1
    assert http.client_processes(9) == min(2, spare)
    assert http.client_processes(128) == min(16, spare)  # 12 on the 16-core GPU machine, 1 on a 2-core CI
    assert http.client_processes(3, asked=8) == 3  # never more processes than streams
    assert http.client_processes(128, asked=20) == 20  # asked: as many as asked


def test_a_shared_prefix_over_http_reports_the_servers_cached_tokens(server: ServerThread,  # noqa: F811
                                                                      tmp_path: Any) -> None:
    """``--prefix-len`` over HTTP as in-process: one prefix before every prompt; the hit rate is the share of prompt
    tokens the server's usage says came from its cache (the first request fills it: 0 of 36, then 32 of 36 twice,
    the 16-token blocks the prefix fills)."""
    path = tmp_path / "prefix.json"
    out = io.StringIO()
    rc = main(["bench", "--base-url", f"{server.url}/v1", "--concurrency", "1", "--num-prompts", "3",
               "--input-len", "4", "--prefix-len", "32", "--output-len", "2", "--seed", "7", "--json", str(path)],
              out=out)
    assert rc == 0, out.getvalue()
    (r,) = json.loads(path.read_text())["runs"]
    assert (r["prefix_len"], r["prompt_tokens"]) == (32, 3 * 36)
    assert r["prefix_cache_hit_rate"] == pytest.approx(64 / 108)
    assert out.getvalue().splitlines()[1].endswith("hit %") and out.getvalue().splitlines()[2].endswith(" 59.3")


def test_the_served_warm_up_draws_prompts_no_timed_run_sends() -> None:
    """A warm-up sending the timed run's shared prefix would leave it cached before the clock starts."""
    from vtcore.bench.served import run_seeds

    for seed in (0, 7):
        warm = [run_seeds(seed, c)[0] for c in (1, 2, 64, 128)]
        timed = [run_seeds(seed, c)[1] for c in (1, 2, 64, 128)]
        assert len(set(timed)) == 4 and not set(warm) & set(timed)


def test_a_negative_prefix_len_is_refused_by_name(capsys: Any) -> None:
    with pytest.raises(SystemExit):  # (argparse's, before any server is asked)
        main(["bench", "--base-url", "http://127.0.0.1:9/v1", "--prefix-len", "-1"], out=io.StringIO())
    assert "--prefix-len='-1': expected an integer >= 0" in capsys.readouterr().err


def test_engine_only_flags_are_refused_with_a_base_url(capsys: Any) -> None:
    assert main(["bench", "--client-processes", "2", "--model", "x"], out=io.StringIO()) == 2
    assert "--client-processes=2: only with --base-url or --serve" in capsys.readouterr().err
    assert main(["bench", "--base-url", "http://127.0.0.1:9/v1", "--compare-prefix-caching"], out=io.StringIO()) == 2
    assert "--base-url measures a server as it runs; --compare-prefix-caching needs" in capsys.readouterr().err
    assert main(["bench", "--base-url", "http://127.0.0.1:9/v1", "--turns", "2"], out=io.StringIO()) == 2
    assert "--base-url measures a server as it runs; --turns needs" in capsys.readouterr().err


def test_an_unreachable_server_is_an_error_naming_it(capsys: Any) -> None:
    rc = main(["bench", "--base-url", "http://127.0.0.1:9/v1", "--concurrency", "1", "--input-len", "4",
               "--output-len", "2"], out=io.StringIO())
    err = capsys.readouterr().err
    assert rc == 2 and "--base-url http://127.0.0.1:9/v1: GET /models failed" in err and "Traceback" not in err


def _fake_server(post: Callable[[Any], None]) -> Any:
    """An OpenAI-shaped server on a free port whose ``/models`` lists one model and whose POSTs ``post`` answers;
    ``shutdown()`` it."""
    import http.server
    import threading

    class Handler(http.server.BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def do_GET(self) -> None:
            body = b'{"object": "list", "data": [{"id": "m", "object": "model"}]}'
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def do_POST(self) -> None:
            self.rfile.read(int(self.headers.get("Content-Length", 0)))
            post(self)

        def log_message(self, *args: Any) -> None:
            pass

    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    return httpd


def _bench(httpd: Any, *more: str) -> tuple[int, str]:
    out = io.StringIO()
    try:
        rc = main(["bench", "--base-url", f"http://127.0.0.1:{httpd.server_address[1]}/v1", "--concurrency", "1",
                   "--num-prompts", "2", "--input-len", "4", "--output-len", "8", "--no-progress", *more], out=out)
    finally:
        httpd.shutdown()
    return rc, out.getvalue()


def test_a_server_answering_an_error_is_one_error_line(capsys: Any) -> None:
    """An OpenAI-shaped server whose completions answer HTTP 500: an error line naming the status and body (it was
    a traceback)."""
    def fail(h: Any) -> None:
        body = b'{"error": "boom"}'
        h.send_response(500)
        h.send_header("Content-Length", str(len(body)))
        h.end_headers()
        h.wfile.write(body)

    rc, _ = _bench(_fake_server(fail))
    err = capsys.readouterr().err
    assert rc != 0 and "HTTP 500: {\"error\": \"boom\"}" in err and "Traceback" not in err, err


def test_a_server_that_stops_before_max_tokens_is_named_in_a_warning() -> None:
    """A server that ignores ignore_eos (three tokens, then "stop") was measured without a word: the table says what
    it returned of what was asked."""
    def short(h: Any) -> None:
        h.send_response(200)
        h.send_header("Content-Type", "text/event-stream")
        h.send_header("Transfer-Encoding", "chunked")
        h.end_headers()
        events = [{"choices": [{"index": 0, "text": "a", "finish_reason": None}]}] * 2 + [
            {"choices": [{"index": 0, "text": "b", "finish_reason": "stop"}]},
            {"choices": [], "usage": {"prompt_tokens": 4, "completion_tokens": 3}}]
        for data in [json.dumps(e).encode() for e in events] + [b"[DONE]"]:
            chunk = b"data: " + data + b"\n\n"
            h.wfile.write(f"{len(chunk):x}\r\n".encode() + chunk + b"\r\n")
        h.wfile.write(b"0\r\n\r\n")

    rc, out = _bench(_fake_server(short))
    assert rc == 0 and ("WARNING: concurrency 1: the server returned 6 output tokens of the 16 asked (finish reasons "
                        "stop): it ended requests before max_tokens") in out, out


def test_bench_serve_starts_a_server_then_runs_in_process(tmp_path: Any) -> None:
    """``--serve``: ``vtcore serve`` in a child process on the bench's config, the loop over HTTP, the server
    stopped, the same loop in-process; the served TTFT split at the server's own (arrival to first token)."""
    path = tmp_path / "served.json"
    out = io.StringIO()
    rc = main(["bench", "--serve", "--device", "cpu", "--concurrency", "2", "--num-prompts", "3", "--input-len", "6",
               "--output-len", "3", "--structured-share", "0.5", "--no-progress", "--json", str(path)], out=out)
    assert rc == 0, out.getvalue()
    doc = json.loads(path.read_text())
    assert doc["mode"] == "served" and doc["served"]["command"][2:4] == ["vtcore.cli.main", "serve"]
    assert "--max-num-seqs" in doc["served"]["command"]  # the bench's own default (its largest concurrency)
    (served,), (inproc,) = doc["served"]["runs"], doc["inprocess"]["runs"]
    for r in (served, inproc):  # (the second of three requests held to the schema, on both sides)
        assert (r["concurrency"], r["num_prompts"], r["output_tokens"]) == (2, 3, 9)
        assert {name: g["requests"] for name, g in r["groups"].items()} == {"constrained": 1, "unconstrained": 2}
    assert 0 < served["server_ttft_mean_s"] < served["ttft_s"]["mean"]  # inside the server, then HTTP and client
    # the engine's steps of the timed run, from its tokens-per-step histogram: each prompt token and each fed-back
    # output token (all but a request's last) computed once
    assert served["server_step_tokens"] == served["prompt_tokens"] + served["output_tokens"] - 3
    # and the timed run's steps alone (not the warm-up's): each request takes a step a token of its 3, at most 2 at
    # once, so 6 steps at least, 9 at most
    assert 6 <= served["server_steps"] <= 9 and f"engine steps {served['server_steps']} " \
        f"(in-process {inproc['steps']})" in out.getvalue()
    assert "served / in-process, c=2: output" in out.getvalue() and "outside the server" in out.getvalue()
    assert served["server_triton_compiles"] == []  # the CPU compiles nothing
    assert "Triton compiles in the server while measured: 0" in out.getvalue()
    busy = served["server_cpu"][0]  # the server's process first, busy through the timed run
    assert 0 <= busy["busiest_thread"] <= busy["cores"] and len(served["client_cpu"]) == served["client_processes"]
    assert "CPU cores (busiest thread): server " in out.getvalue() and " clients " in out.getvalue()


def test_bench_serve_refuses_what_only_one_side_has(capsys: Any) -> None:
    assert main(["bench", "--serve", "--offline"], out=io.StringIO()) == 2
    assert "--serve compares the served loop with the in-process one; the served loop cannot take --offline" in \
        capsys.readouterr().err
    assert main(["bench", "--serve", "--base-url", "http://127.0.0.1:9/v1"], out=io.StringIO()) == 2
    assert "--serve needs an engine in this process" in capsys.readouterr().err
