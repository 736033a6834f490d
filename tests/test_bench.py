"""``vtcore bench``: structure and self-consistency of the serving benchmark (no performance thresholds)."""
from __future__ import annotations

import argparse
import io
import json

import pytest

from vtcore.bench.serving import add_bench_parser, parse_concurrency, resolve_lengths

INPUT_LEN, OUTPUT_LEN, NUM_PROMPTS = 16, 8, 4


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="vtcore")
    add_bench_parser(p.add_subparsers(dest="command", required=True))
    return p


@pytest.fixture(scope="module")
def bench_doc(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict, str]:
    path = tmp_path_factory.mktemp("bench") / "bench.json"
    args = _parser().parse_args(["bench", "--device", "cpu", "--concurrency", "1,2", "--input-len", str(INPUT_LEN),
                                 "--output-len", str(OUTPUT_LEN), "--num-prompts", str(NUM_PROMPTS),
                                 "--json", str(path), "--no-progress"])
    out = io.StringIO()
    assert args.func(args, out) == 0
    return json.loads(path.read_text()), out.getvalue()


def test_bench_json_structure(bench_doc):
    doc, table = bench_doc
    assert doc["device"] == "cpu" and doc["input_len"] == INPUT_LEN and doc["output_len"] == OUTPUT_LEN
    assert doc["input_len_clamped"] is False
    assert [r["concurrency"] for r in doc["runs"]] == [1, 2]
    for run in doc["runs"]:
        assert run["num_prompts"] == NUM_PROMPTS and len(run["requests"]) == NUM_PROMPTS
        for key in ("ttft_s", "tpot_s", "itl_s", "latency_s"):
            assert set(run[key]) == {"mean", "median", "p90", "p99", "count"}
        assert run["peak_gpu_memory_bytes"] is None  # CPU: no GPU memory to report
        assert isinstance(run["steps"], int) and run["steps"] > 0
        assert run["host_submit_ms_mean"] is not None and run["host_submit_ms_mean"] > 0
    # the table has one row per concurrency
    rows = [line.split() for line in table.splitlines()[2:] if line.strip() and not line.startswith("wrote")]
    assert [int(r[0]) for r in rows] == [1, 2]


def test_bench_per_request_consistency(bench_doc):
    doc, _ = bench_doc
    for run in doc["runs"]:
        ids = set()
        for r in run["requests"]:
            ids.add(r["request_id"])
            assert r["prompt_tokens"] == INPUT_LEN
            assert r["output_tokens"] == OUTPUT_LEN == sum(r["arrival_token_counts"])
            assert r["finish_reason"] == "length"
            assert 0 < r["ttft_s"] <= r["latency_s"]
            assert r["latency_s"] == pytest.approx(r["done_time"] - r["send_time"])
            assert r["tpot_s"] == pytest.approx((r["latency_s"] - r["ttft_s"]) / (OUTPUT_LEN - 1))
            assert len(r["itl_s"]) == len(r["arrival_token_counts"]) - 1
            assert all(g >= 0 for g in r["itl_s"])
            assert sum(r["itl_s"]) <= r["latency_s"] - r["ttft_s"] + 1e-9
            assert run["start_time"] <= r["send_time"] <= r["done_time"] <= run["end_time"]
        assert len(ids) == NUM_PROMPTS
        # closed loop: never more than c requests in flight at once
        events = sorted([(r["send_time"], 1) for r in run["requests"]] + [(r["done_time"], -1) for r in run["requests"]],
                        key=lambda e: (e[0], e[1]))
        live = peak = 0
        for _, d in events:
            live += d
            peak = max(peak, live)
        assert peak <= run["concurrency"]


def test_bench_aggregates_consistent(bench_doc):
    doc, _ = bench_doc
    for run in doc["runs"]:
        reqs = run["requests"]
        wall = run["wall_s"]
        assert wall == pytest.approx(run["end_time"] - run["start_time"])
        assert run["prompt_tokens"] == sum(r["prompt_tokens"] for r in reqs) == NUM_PROMPTS * INPUT_LEN
        assert run["output_tokens"] == sum(r["output_tokens"] for r in reqs) == NUM_PROMPTS * OUTPUT_LEN
        assert run["total_throughput_tok_s"] == pytest.approx((run["prompt_tokens"] + run["output_tokens"]) / wall)
        assert run["output_throughput_tok_s"] == pytest.approx(run["output_tokens"] / wall)
        ttfts = [r["ttft_s"] for r in reqs]
        assert run["ttft_s"]["mean"] == pytest.approx(sum(ttfts) / len(ttfts))
        assert run["ttft_s"]["count"] == NUM_PROMPTS
        assert run["itl_s"]["count"] == sum(len(r["itl_s"]) for r in reqs)
        for key in ("ttft_s", "tpot_s", "itl_s", "latency_s"):
            s = run[key]
            assert s["median"] <= s["p90"] <= s["p99"]
            assert s["p99"] <= max(x for r in reqs for x in (r[key] if key == "itl_s" else [r[key]]))


@pytest.mark.parametrize("bad", ["0", "x", "1,0", "2,x", ""])
def test_bad_concurrency_is_named(bad, capsys):
    with pytest.raises(argparse.ArgumentTypeError, match=r"--concurrency=.*is not a positive integer"):
        parse_concurrency(bad)
    with pytest.raises(SystemExit) as exc:
        _parser().parse_args(["bench", "--concurrency", bad])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "--concurrency" in err and repr(bad) in err


def test_input_len_clamp_and_error():
    assert resolve_lengths(1024, None, 128) == (1024 - 128, True)
    assert resolve_lengths(4096, None, 128) == (1024, False)
    assert resolve_lengths(1024, 16, 8) == (16, False)
    with pytest.raises(ValueError, match=r"--input-len=1000 .*--output-len=128.*max_model_len=1024"):
        resolve_lengths(1024, 1000, 128)
