"""``vtcore bench``: structure and self-consistency of the serving benchmark (no performance thresholds)."""
from __future__ import annotations

import argparse
import io
import json
import math
import os

import pytest

from vtcore.bench.serving import add_bench_parser, parse_concurrency, resolve_lengths, resolve_offline_lengths
from vtcore.config import DEFAULT_MODEL

INPUT_LEN, OUTPUT_LEN, NUM_PROMPTS = 16, 8, 4
COPY_MIB = "16"  # the default 256 MiB copy is the real measurement; small here to keep CPU tests quick


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="vtcore")
    add_bench_parser(p.add_subparsers(dest="command", required=True))
    return p


@pytest.fixture(scope="module")
def bench_doc(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict, str]:
    path = tmp_path_factory.mktemp("bench") / "bench.json"
    args = _parser().parse_args(["bench", "--device", "cpu", "--concurrency", "1,2", "--input-len", str(INPUT_LEN),
                                 "--output-len", str(OUTPUT_LEN), "--num-prompts", str(NUM_PROMPTS),
                                 "--peer", "hf", "--copy-mib", COPY_MIB, "--json", str(path), "--no-progress"])
    out = io.StringIO()
    assert args.func(args, out) == 0
    return json.loads(path.read_text()), out.getvalue()


def _run(tmp_path, argv: list[str]) -> tuple[dict, str]:
    path = tmp_path / "bench.json"
    args = _parser().parse_args(["bench", "--device", "cpu", "--no-progress", "--json", str(path), *argv])
    out = io.StringIO()
    assert args.func(args, out) == 0
    return json.loads(path.read_text()), out.getvalue()


def _rows(table: str) -> list[list[str]]:
    """The per-concurrency rows: after the two header lines, up to the first blank line."""
    rows = []
    for line in table.splitlines()[2:]:
        if not line.strip():
            break
        rows.append(line.split())
    return rows


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
    rows = _rows(table)
    assert [int(r[0]) for r in rows] == [1, 2]
    assert "roofline: copy bandwidth" in table and "peer hf (transformers" in table


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


# ---------------------------------------------------------------------------------------- --peer hf
def test_peer_hf_measured_and_ratio(bench_doc):
    doc, _ = bench_doc
    peer = doc["peer"]
    assert peer["name"] == "hf" and peer["skipped"] is False and peer["skip_reason"] is None
    k = min(NUM_PROMPTS, 4)
    hf = peer["hf"]
    assert peer["num_prompts"] == hf["num_prompts"] == len(hf["prompts"]) == k
    assert peer["same_prompts_as_concurrency_1"] is True
    for p in hf["prompts"]:
        assert p["prompt_tokens"] == INPUT_LEN and p["output_tokens"] == OUTPUT_LEN
        assert 0 < p["first_token_s"] < p["total_s"]
        assert p["tpot_s"] == pytest.approx((p["total_s"] - p["first_token_s"]) / (OUTPUT_LEN - 1))
    assert peer["hf_tpot_s"] == hf["tpot_s"] > 0
    assert hf["tpot_s"] == pytest.approx(sum(p["tpot_s"] for p in hf["prompts"]) / k)
    assert hf["output_tok_s"] == pytest.approx(k * OUTPUT_LEN / sum(p["total_s"] for p in hf["prompts"]))
    assert hf["decode_tok_s"] == pytest.approx(1 / hf["tpot_s"])
    c1 = next(r for r in doc["runs"] if r["concurrency"] == 1)
    vt = sum(r["tpot_s"] for r in c1["requests"][:k]) / k
    assert peer["vtcore_tpot_s"] == pytest.approx(vt) and vt > 0
    assert peer["tpot_ratio"] == pytest.approx(peer["vtcore_tpot_s"] / peer["hf_tpot_s"])


def test_peer_hf_skipped_for_dummy_weights(tmp_path):
    doc, table = _run(tmp_path, ["--load-format", "dummy", "--peer", "hf", "--concurrency", "1", "--num-prompts", "1",
                                 "--input-len", "8", "--output-len", "4", "--copy-mib", COPY_MIB])
    peer = doc["peer"]
    assert peer["skipped"] is True and "hf" not in peer and "tpot_ratio" not in peer
    assert "--load-format dummy" in peer["skip_reason"] and "weights" in peer["skip_reason"]
    assert "peer hf: skipped: --load-format dummy" in table


# ---------------------------------------------------------------------------------------- roofline
def _independent_bytes() -> tuple[int, int]:
    """(parameter bytes, KV bytes per token) of the default model in float32, from its files alone."""
    from safetensors import safe_open

    with open(os.path.join(DEFAULT_MODEL, "config.json")) as f:
        cfg = json.load(f)
    with safe_open(os.path.join(DEFAULT_MODEL, "model.safetensors"), framework="pt") as f:
        numel = sum(math.prod(f.get_slice(name).get_shape()) for name in f.keys())
    if not cfg.get("tie_word_embeddings"):
        pytest.skip("the independent count assumes the default model's tied LM head")
    kv = cfg["num_hidden_layers"] * 2 * cfg["num_key_value_heads"] * cfg["head_dim"] * 4
    return numel * 4, kv


def test_roofline_bytes_and_bandwidth(bench_doc):
    doc, table = bench_doc
    assert doc["dtype"] == "float32"
    param_bytes, kv_per_token = _independent_bytes()
    rl = doc["roofline"]
    assert rl["param_bytes"] == param_bytes and rl["kv_bytes_per_token"] == kv_per_token
    copy = rl["copy"]
    assert copy["nbytes"] == int(COPY_MIB) * 2**20 and copy["bytes_moved_per_copy"] == 2 * copy["nbytes"]
    assert len(copy["times_s"]) >= 3 and all(t > 0 for t in copy["times_s"])
    assert copy["median_s"] == pytest.approx(sorted(copy["times_s"])[len(copy["times_s"]) // 2])
    bw = rl["copy_bandwidth_bytes_s"]
    assert bw > 0 and bw == pytest.approx(copy["bytes_moved_per_copy"] / copy["median_s"])
    for run, row in zip(doc["runs"], _rows(table)):
        c = run["concurrency"]
        r = run["roofline"]
        kv = c * kv_per_token * (INPUT_LEN + OUTPUT_LEN / 2)
        assert r["param_bytes"] == param_bytes and r["kv_bytes"] == kv and r["bytes"] == param_bytes + kv
        assert r["roofline_ms"] == pytest.approx(r["bytes"] / bw * 1e3)
        assert r["tpot_over_roofline"] == pytest.approx(run["tpot_s"]["mean"] / (r["roofline_ms"] / 1e3))
        assert float(row[-2]) == pytest.approx(r["roofline_ms"], abs=1e-3)


# ---------------------------------------------------------------------------------------- --offline
def test_offline_counts_tokens(tmp_path):
    doc, table = _run(tmp_path, ["--offline", "--offline-min-len", "4", "--offline-max-len", "12",
                                 "--num-prompts", "6"])
    o = doc["offline"]
    assert doc["mode"] == "offline" and doc["runs"] == []
    assert o["num_prompts"] == 6 and (o["min_len"], o["max_len"]) == (4, 12) and o["lengths_clamped"] is False
    assert 6 * 4 <= o["prompt_tokens"] <= 6 * 12 and 6 * 4 <= o["requested_output_tokens"] <= 6 * 12
    # ignore_eos: every request produced exactly its max_tokens
    assert o["output_tokens"] == o["requested_output_tokens"] and o["finish_reasons"] == ["length"]
    assert o["wall_s"] > 0 and o["output_throughput_tok_s"] == pytest.approx(o["output_tokens"] / o["wall_s"])
    assert f"output tokens {o['output_tokens']}" in table


def test_offline_lengths_clamped_and_validated():
    assert resolve_offline_lengths(4096, 100, 1024) == (100, 1024, False)
    assert resolve_offline_lengths(1024, 100, 1024) == (100, 512, True)
    assert resolve_offline_lengths(100, 60, 80) == (50, 50, True)
    with pytest.raises(ValueError, match="--offline-min-len=9 exceeds --offline-max-len=8"):
        resolve_offline_lengths(1024, 9, 8)
