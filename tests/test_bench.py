"""``vtcore bench``: structure and self-consistency of the serving benchmark (no performance thresholds)."""
from __future__ import annotations

import argparse
import io
import json
import math
import os

import pytest

from vtcore.bench.serving import add_bench_parser, parse_concurrency, resolve_lengths, resolve_offline_lengths
from vtcore.bench.structured_share import bench_schema
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
        assert run["triton_compiles"] == []  # the CPU path compiles nothing (and the warm-up ran first)
        loop = run["engine_loop"]  # every step call timed, phase by phase; each submit inside one of them
        assert loop["steps"] >= run["steps"] and all(v >= 0 for v in loop["ms_per_step"].values())
        # its submit phase encloses every span the submit timer measures (inside the same calls)
        assert loop["ms_per_step"]["submit"] * loop["steps"] >= run["host_submit_ms_mean"] * run["steps"] * (1 - 1e-9)
    # the table has one row per concurrency
    rows = _rows(table)
    assert [int(r[0]) for r in rows] == [1, 2]
    assert "roofline: copy bandwidth" in table and "peer hf (transformers" in table
    assert table.count("engine loop c=") == 2


# ---------------------------------------------------------------------------------------- engine knobs
def test_engine_knobs_defaults_recorded(bench_doc):
    doc, table = bench_doc
    # read back from the engine: max_num_seqs defaults to the largest concurrency; on CPU the runner still
    # pads decode batches to its graph sizes (captured only on CUDA); the Qwen3 family runs async at depth 2
    assert (doc["enforce_eager"], doc["async_scheduling"], doc["max_num_seqs"]) == (False, "auto", 2)
    assert doc["decode_graph_sizes"] == [1, 2] and doc["async_depth"] == 2
    assert "enforce_eager=False async_scheduling=auto (depth 2) max_num_seqs=2 decode_graph_sizes=1,2" in \
        table.splitlines()[0]


def test_engine_knobs_reach_engine(tmp_path):
    doc, table = _run(tmp_path, ["--enforce-eager", "--no-async-scheduling", "--max-num-seqs", "3",
                                 "--concurrency", "1", "--num-prompts", "1", "--input-len", "8", "--output-len", "4",
                                 "--peer", "hf", "--copy-mib", COPY_MIB])
    assert (doc["enforce_eager"], doc["async_scheduling"], doc["max_num_seqs"]) == (True, "off", 3)
    assert doc["decode_graph_sizes"] == [] and doc["async_depth"] == 1  # eager: no padded graph sizes; sync
    assert "enforce_eager=True async_scheduling=off (depth 1) max_num_seqs=3 decode_graph_sizes=none" in \
        table.splitlines()[0]
    # largest concurrency 1: the batch-1 peer runs, the batched one has nothing to batch
    b = doc["peer"]["batched"]
    assert doc["peer"]["skipped"] is False and b["skipped"] is True and b["concurrency"] == 1
    assert "largest concurrency is 1" in b["skip_reason"] and "peer hf batched: skipped" in table


@pytest.mark.parametrize("argv", [["--async-scheduling=off"], ["--max-num-seqs", "0"]])
def test_bad_engine_knobs_rejected(argv, capsys):
    with pytest.raises(SystemExit) as exc:
        _parser().parse_args(["bench", *argv])
    assert exc.value.code == 2 and argv[0].split("=")[0] in capsys.readouterr().err  # the flag named


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
    # after a shared prefix: the limit is the model's, and the prefix is named (it said max_model_len=4)
    assert resolve_lengths(1024, None, 8, prefix_len=1000) == (16, True)
    with pytest.raises(ValueError, match=r"^--prefix-len=1000 \+ --input-len=32 \+ --output-len=8 = 1040 exceeds "
                                         r"max_model_len=1024$"):
        resolve_lengths(1024, 32, 8, prefix_len=1000)
    with pytest.raises(ValueError, match=r"^--prefix-len=1020 \+ --output-len=8: leaves no room for a prompt in "
                                         r"max_model_len=1024$"):
        resolve_lengths(1024, None, 8, prefix_len=1020)


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
        # two separate generate calls: on a loaded CPU the 1-token one can take longer (seen in CI)
        assert p["first_token_s"] > 0 and p["total_s"] > 0
        assert p["tpot_s"] == pytest.approx((p["total_s"] - p["first_token_s"]) / (OUTPUT_LEN - 1))
    assert peer["hf_tpot_s"] == hf["tpot_s"] > 0
    assert hf["tpot_s"] == pytest.approx(sum(p["tpot_s"] for p in hf["prompts"]) / k)
    assert hf["output_tok_s"] == pytest.approx(k * OUTPUT_LEN / sum(p["total_s"] for p in hf["prompts"]))
    assert hf["decode_tok_s"] == pytest.approx(1 / hf["tpot_s"])
    c1 = next(r for r in doc["runs"] if r["concurrency"] == 1)
    vt = sum(r["tpot_s"] for r in c1["requests"][:k]) / k
    assert peer["vtcore_tpot_s"] == pytest.approx(vt) and vt > 0
    assert peer["tpot_ratio"] == pytest.approx(peer["vtcore_tpot_s"] / peer["hf_tpot_s"])
    assert hf["weights"] == "checkpoint"


def _check_batched(doc: dict, table: str, c: int, input_len: int, output_len: int) -> None:
    """HF's batched generate at the largest concurrency c: its arithmetic and the ratio to vtcore's run at c."""
    b = doc["peer"]["batched"]
    run = next(r for r in doc["runs"] if r["concurrency"] == c)
    assert b["skipped"] is False and b["concurrency"] == b["batch_size"] == b["num_prompts"] == c
    assert b["prompt_tokens"] == c * input_len and b["left_padded"] is False
    assert b["output_tokens"] == c * output_len and b["time_s"] > 0
    assert b["output_tok_s"] == pytest.approx(c * output_len / b["time_s"])
    assert b["vtcore_output_tok_s"] == run["output_throughput_tok_s"]
    assert b["throughput_ratio"] == pytest.approx(run["output_throughput_tok_s"] / b["output_tok_s"])
    assert f"vtcore/HF output throughput {b['throughput_ratio']:.2f}x" in table


def test_peer_hf_batched_at_largest_concurrency(bench_doc):
    doc, table = bench_doc
    _check_batched(doc, table, 2, INPUT_LEN, OUTPUT_LEN)


def test_peer_hf_dummy_weights_random_init(tmp_path):
    """A folder with only config.json (as on the GPU runs): HF cannot load a checkpoint from it, so the peer
    running at all shows HF's model was built from the config with random weights."""
    folder = tmp_path / "shape_only"
    folder.mkdir()
    (folder / "config.json").write_text(open(os.path.join(DEFAULT_MODEL, "config.json")).read())
    doc, table = _run(tmp_path, ["--model", str(folder), "--load-format", "dummy", "--peer", "hf",
                                 "--concurrency", "1,3", "--num-prompts", "3", "--input-len", "8", "--output-len", "4",
                                 "--copy-mib", COPY_MIB])
    peer = doc["peer"]
    assert peer["skipped"] is False and peer["skip_reason"] is None
    assert peer["hf"]["weights"] == "random (from config), same shape as vtcore's dummy weights"
    assert peer["num_prompts"] == 3 and all(p["output_tokens"] == 4 for p in peer["hf"]["prompts"])
    assert "random (from config)" in table
    _check_batched(doc, table, 3, 8, 4)


def test_peer_hf_skipped_for_one_output_token():
    from vtcore.bench.peer import skip_reason

    assert skip_reason(2) is None and "--output-len=1" in skip_reason(1)


class _StubModel:
    """Stands in for HF's model: records what generate got, sleeps, appends ``new`` tokens per row."""

    def __init__(self, new=None, sleep_s=0.02):
        self.calls, self.new, self.sleep_s = [], new, sleep_s

    def generate(self, ids, attention_mask, do_sample, max_new_tokens, min_new_tokens, pad_token_id):
        import time

        import torch

        self.calls.append((ids.tolist(), attention_mask.tolist(), max_new_tokens, min_new_tokens, do_sample))
        time.sleep(self.sleep_s)
        n = max_new_tokens if self.new is None else self.new
        return torch.cat([ids, torch.zeros(ids.shape[0], n, dtype=ids.dtype)], dim=1)


def test_run_batched_left_pads_times_and_divides():
    import torch

    from vtcore.bench.peer import run_batched

    stub = _StubModel()
    b = run_batched(stub, torch.device("cpu"), [[5, 6, 7], [8], [9, 10]], 6, pad_token_id=1, vtcore_output_tok_s=50.0)
    ids, mask = [[5, 6, 7], [1, 1, 8], [1, 9, 10]], [[1, 1, 1], [0, 0, 1], [0, 1, 1]]
    # one untimed warm-up of 2 tokens on the same batch, then the timed generate forced to exactly 6 greedy tokens
    assert stub.calls == [(ids, mask, 2, 2, False), (ids, mask, 6, 6, False)]
    assert b["left_padded"] is True and b["batch_size"] == 3 and b["prompt_tokens"] == 6 and b["output_tokens"] == 18
    assert 0.02 <= b["time_s"] < 1.0 and b["output_tok_s"] == pytest.approx(18 / b["time_s"])
    assert b["throughput_ratio"] == pytest.approx(50.0 / b["output_tok_s"])
    with pytest.raises(RuntimeError, match="produced 5 tokens per row, expected 6"):
        run_batched(_StubModel(new=5, sleep_s=0), torch.device("cpu"), [[1, 2]], 6, None)


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
        assert float(row[-3]) == pytest.approx(r["roofline_ms"], abs=1e-3)


def test_prefill_floor_counts_the_default_models_operations(bench_doc):
    """The floor's operation count equals one made from the config alone (q, k, v, o, gate, up, down per
    layer, the tied LM head once, causal attention), and TTFT / floor is the c=1 run's median over it."""
    doc, table = bench_doc
    with open(os.path.join(DEFAULT_MODEL, "config.json")) as f:
        cfg = json.load(f)
    h, i, nq, nkv, hd = (cfg[k] for k in ("hidden_size", "intermediate_size", "num_attention_heads",
                                            "num_key_value_heads", "head_dim"))
    layers, n = cfg["num_hidden_layers"], INPUT_LEN
    per_token = 2 * layers * (h * (nq + 2 * nkv) * hd + nq * hd * h + 3 * h * i)
    expected = per_token * n + 2 * cfg["vocab_size"] * h + layers * 2 * nq * hd * n * (n + 1)
    pf = doc["prefill_floor"]
    assert pf["prompt_tokens"] == n and pf["flops"] == expected
    mm = pf["matmul"]
    assert mm["dtype"] == "float32" and mm["flop_s"] == pytest.approx(2 * mm["side"] ** 3 / mm["median_s"])
    assert pf["floor_ms"] == pytest.approx(expected / mm["flop_s"] * 1e3)
    lone = next(r for r in doc["runs"] if r["concurrency"] == 1)
    assert pf["ttft_median_over_floor"] == pytest.approx(lone["ttft_s"]["median"] * 1e3 / pf["floor_ms"])
    assert f"prefill floor: {n}-token prompt, {expected / 1e12:.3f} TFLOP" in table


def test_the_closed_loop_floor_adds_the_prompts_admitted_meanwhile(bench_doc):
    """Each concurrency's closed-loop floor: the KV read at copy bandwidth plus the larger of the weights at
    copy bandwidth and the matrix operations of c decode tokens (the config's, LM head included) and
    (c - 1) / output_len prompts at the matmul rate; concurrency 1 admits none meanwhile."""
    doc, table = bench_doc
    with open(os.path.join(DEFAULT_MODEL, "config.json")) as f:
        cfg = json.load(f)
    h, i, nq, nkv, hd = (cfg[k] for k in ("hidden_size", "intermediate_size", "num_attention_heads",
                                            "num_key_value_heads", "head_dim"))
    token = 2 * cfg["num_hidden_layers"] * (h * (nq + 2 * nkv) * hd + nq * hd * h + 3 * h * i) \
        + 2 * cfg["vocab_size"] * h
    bw, rate = doc["roofline"]["copy_bandwidth_bytes_s"], doc["prefill_floor"]["matmul"]["flop_s"]
    for run in doc["runs"]:
        c, r = run["concurrency"], run["roofline"]
        cl = r["closed_loop"]
        assert cl["prompts_per_step"] == pytest.approx((c - 1) / OUTPUT_LEN)
        matmul_ms = (c * token + cl["prompts_per_step"] * doc["prefill_floor"]["flops"]) / rate * 1e3
        assert cl["matmul_ms"] == pytest.approx(matmul_ms)
        assert cl["floor_ms"] == pytest.approx(r["kv_bytes"] / bw * 1e3 + max(r["param_bytes"] / bw * 1e3, matmul_ms))
        assert cl["tpot_over_floor"] == pytest.approx(run["tpot_s"]["mean"] * 1e3 / cl["floor_ms"])
        assert f"closed-loop floor c={c}: {cl['floor_ms']:.3f} ms" in table


def test_prefill_flops_counts_a_tokens_share_of_routed_experts_and_refuses_packed_weights():
    import torch

    from vtcore.bench.roofline import prefill_flops

    class Routed(torch.nn.Module):
        def __init__(self, dtype: torch.dtype = torch.float32) -> None:
            super().__init__()
            self.w = torch.nn.Parameter(torch.zeros(64, 16, dtype=dtype), requires_grad=False)
            self.norm = torch.nn.Parameter(torch.zeros(16))  # one dimension: no operands

        def active_fraction(self, batch: int) -> float:
            return 1 - (1 - 0.25) ** batch

    model = torch.nn.Sequential(Routed(), torch.nn.Linear(8, 8, bias=False))
    assert prefill_flops(model, [], 3) == 3 * (2 * 1024 * 0.25 + 2 * 64)
    assert prefill_flops(torch.nn.Sequential(Routed(torch.uint8)), [], 3) is None


# ---------------------------------------------------------------------------------------- --offline
def test_offline_counts_tokens(tmp_path):
    doc, table = _run(tmp_path, ["--offline", "--offline-min-len", "4", "--offline-max-len", "12",
                                 "--num-prompts", "6", "--enforce-eager", "--no-async-scheduling"])
    o = doc["offline"]
    # the knobs reach LLM(...): eager (no padded graph sizes), sync, and max_num_seqs's offline default
    assert (doc["enforce_eager"], doc["decode_graph_sizes"], doc["async_depth"], doc["max_num_seqs"]) == \
        (True, [], 1, 256)
    assert "enforce_eager=True async_scheduling=off (depth 1) max_num_seqs=256" in table
    assert doc["mode"] == "offline" and doc["runs"] == []
    assert o["num_prompts"] == 6 and (o["min_len"], o["max_len"]) == (4, 12) and o["lengths_clamped"] is False
    assert 6 * 4 <= o["prompt_tokens"] <= 6 * 12 and 6 * 4 <= o["requested_output_tokens"] <= 6 * 12
    # ignore_eos: every request produced exactly its max_tokens
    assert o["output_tokens"] == o["requested_output_tokens"] and o["finish_reasons"] == ["length"]
    assert o["wall_s"] > 0 and o["output_throughput_tok_s"] == pytest.approx(o["output_tokens"] / o["wall_s"])
    assert f"output tokens {o['output_tokens']}" in table


@pytest.mark.parametrize("flag", ["--input-len", "--output-len"])
def test_offline_refuses_a_length_it_would_not_use(flag):
    args = _parser().parse_args(["bench", "--device", "cpu", "--no-progress", "--offline", flag, "8"])
    with pytest.raises(ValueError, match=rf"{flag}=8: does not apply with --offline .*--offline-min-len"):
        args.func(args, io.StringIO())


def test_offline_lengths_clamped_and_validated():
    assert resolve_offline_lengths(4096, 100, 1024) == (100, 1024, False)
    assert resolve_offline_lengths(1024, 100, 1024) == (100, 512, True)
    assert resolve_offline_lengths(100, 60, 80) == (50, 50, True)
    with pytest.raises(ValueError, match="--offline-min-len=9 exceeds --offline-max-len=8"):
        resolve_offline_lengths(1024, 9, 8)


# ---------------------------------------------------------------------------------------- per decode step
def test_decode_step_host_time_split(bench_doc):
    doc, table = bench_doc
    for run, row in zip(doc["runs"], _rows(table)):
        dec, other = run["step_host_s"]["decode"], run["step_host_s"]["other"]
        # every submit is either a pure decode step or not, and steps counts the submits
        assert run["decode_steps"] == dec["count"] and dec["count"] + other["count"] == run["steps"]
        assert 0 < dec["median"] <= dec["p90"] <= dec["p99"] and other["count"] > 0
        mean = (dec["mean"] * dec["count"] + other["mean"] * other["count"]) / run["steps"]
        assert mean * 1e3 == pytest.approx(run["host_submit_ms_mean"])
        assert row[-7] == f"{dec['median'] * 1e3:.2f}/{dec['p90'] * 1e3:.2f}"
    # concurrency 1 never mixes requests: one prefill step and OUTPUT_LEN - 1 decode steps per request
    c1 = doc["runs"][0]
    assert c1["decode_steps"] == NUM_PROMPTS * (OUTPUT_LEN - 1) and c1["step_host_s"]["other"]["count"] == NUM_PROMPTS


def test_decode_step_device_stats_absent_on_cpu(bench_doc):
    doc, table = bench_doc
    for run, row in zip(doc["runs"], _rows(table)):
        d = run["decode_device"]
        assert d["reason"] == "no CUDA device" and d["profiled"] is False and d["steps"] == 0
        assert d["device_ms_per_step"] is None and d["kernels_per_step"] is None and d["wall_ms_per_step"] is None
        assert row[-6:-4] == ["-", "-"]
        assert f"decode step c={run['concurrency']}: host" in table
    assert "device time and kernels not measured (no CUDA device)" in table


def _rec(kind: str, dur: float, name: str = "k") -> tuple[str, str, float]:
    return (name, kind, dur)


def test_aggregate_device_counts_kernels_per_step():
    from vtcore.bench.step_stats import aggregate_device

    records = [_rec("kernel", 10.0), _rec("kernel", 30.0), _rec("kernel", 20.0), _rec("kernel", 4.0),
               _rec("gpu_memcpy", 100.0, "Memcpy HtoD (Pinned -> Device)"), _rec("gpu_memcpy", 60.0),
               _rec("gpu_memset", 7.0, "Memset (Device)"), _rec("cpu_op", 500.0, "aten::mm"),
               _rec("cuda_runtime", 9.0, "cudaLaunchKernel"), _rec("gpu_user_annotation", 300.0)]
    a = aggregate_device(records, 4, 0.010)
    assert a["steps"] == 4 and a["reason"] is None
    assert a["kernels_per_step"] == 1.0  # 4 kernels / 4 steps: memcpy, memset, runtime and CPU ops are not kernels
    assert a["device_ms_per_step"] == pytest.approx(64.0 / 4 / 1e3) and a["collective_ms_per_step"] == 0.0
    nccl = _rec("kernel", 8.0, "ncclDevKernel_AllReduce_Sum_bf16_RING_LL(ncclDevKernelArgsStorage<4096ul>)")
    tp = aggregate_device(records + [nccl, _rec("kernel", 6.0, "ncclDevKernel_AllGather_RING_LL")], 2, 0.010)
    assert tp["collective_ms_per_step"] == pytest.approx(14.0 / 2 / 1e3)
    assert tp["device_ms_per_step"] == pytest.approx(78.0 / 2 / 1e3)
    assert a["memcpy_per_step"] == 0.5 and a["memcpy_ms_per_step"] == pytest.approx(160.0 / 4 / 1e3)
    assert a["memset_per_step"] == 0.25
    assert a["wall_ms_per_step"] == pytest.approx(2.5)


def test_aggregate_device_no_kernels_or_steps_is_none_with_reason():
    from vtcore.bench.step_stats import aggregate_device

    a = aggregate_device([_rec("gpu_memcpy", 5.0), _rec("cpu_op", 50.0)], 3, 0.003)
    assert a["kernels_per_step"] is None and a["device_ms_per_step"] is None  # never 0 kernels
    assert "no kernel events in 3 decode steps" in a["reason"] and "CUDA graph" in a["reason"]
    assert a["memcpy_per_step"] == pytest.approx(1 / 3) and a["wall_ms_per_step"] == pytest.approx(1.0)
    z = aggregate_device([_rec("kernel", 5.0)], 0, None)
    assert z["kernels_per_step"] is None and z["wall_ms_per_step"] is None and z["reason"]


def test_records_from_kineto_kinds():
    from types import SimpleNamespace

    from vtcore.bench.step_stats import records_from_kineto

    def ev(name, device, activity=None, ns=2000):
        e = SimpleNamespace(name=lambda: name, device_type=lambda: SimpleNamespace(name=device),
                            duration_ns=lambda: ns)
        if activity is not None:
            e.activity_type = lambda: activity
        return e

    # activity_type wins; without it (older torch) the device type and kineto's copy/fill names decide
    events = [ev("gemm", "CUDA", "kernel"), ev("Memcpy DtoH", "CUDA", "gpu_memcpy"), ev("aten::mm", "CPU", "cpu_op"),
              ev("ann", "CUDA", "gpu_user_annotation"), ev("gemm", "CUDA"), ev("Memcpy HtoD", "CUDA"),
              ev("Memset (Device)", "CUDA"), ev("aten::add", "CPU")]
    assert records_from_kineto(events) == [
        ("gemm", "kernel", 2.0), ("Memcpy DtoH", "gpu_memcpy", 2.0), ("aten::mm", "cpu_op", 2.0),
        ("ann", "gpu_user_annotation", 2.0), ("gemm", "kernel", 2.0), ("Memcpy HtoD", "gpu_memcpy", 2.0),
        ("Memset (Device)", "gpu_memset", 2.0), ("aten::add", "cpu_op", 2.0)]


class _FakeBackend:
    name = "fake"

    def __init__(self, *_a):
        self.calls = []

    def sync(self):
        self.calls.append("sync")

    def start(self):
        self.calls.append("start")

    def stop(self):
        self.calls.append("stop")
        return [("k", "kernel", 1.0)] * 6


def test_decode_window_skips_opens_and_closes():
    from types import SimpleNamespace

    from vtcore.bench.step_stats import DecodeWindow, is_decode

    def batch(*ns):
        return [SimpleNamespace(num_tokens=n) for n in ns]

    assert is_decode(batch(1, 1)) and not is_decode(batch(1, 5)) and not is_decode([])

    def drive(w, batches):
        for b in batches:
            w.before(b, is_decode(b))
            w.after()

    # a prefill and a partial decode batch do not count; 2 full decode steps skipped, then 3 profiled
    w = DecodeWindow(skip=2, steps=3, batch_size=2, backend=_FakeBackend())
    drive(w, [batch(8, 8), batch(1), batch(1, 1), batch(1, 1), batch(1, 1), batch(1, 1), batch(1, 1), batch(1, 1)])
    assert (w.state, w.closed_by, w.steps, w.seqs) == ("closed", "full", 3, 6)
    assert w.backend.calls == ["sync", "start", "sync", "stop"] and len(w.records) == 6 and w.wall_s >= 0
    # a non-decode step closes the window early, before its own submit is counted
    w = DecodeWindow(skip=0, steps=10, batch_size=1, backend=_FakeBackend())
    drive(w, [batch(1), batch(1), batch(4), batch(1)])
    assert (w.state, w.closed_by, w.steps) == ("closed", "non-decode step", 2)
    w = DecodeWindow(skip=0, steps=10, batch_size=2, backend=_FakeBackend())
    drive(w, [batch(1, 1), batch(1)])
    assert (w.closed_by, w.steps) == ("batch shrank to 1", 1)


def test_probe_decode_runs_profiler_on_engine_thread():
    """The real probe through AsyncLLM on CPU with a CPU-only torch.profiler: the window is opened and
    closed on the engine thread, sees CPU ops but no kernels, and so reports kernels as None."""
    import asyncio
    import random

    from vtcore.bench.step_stats import TorchProfiler, probe_decode
    from vtcore.engine.async_llm import AsyncLLM

    engine = AsyncLLM(device="cpu", max_model_len=64)
    try:
        def cpu_only(device):
            return TorchProfiler(device, ("cpu",))

        full = asyncio.run(probe_decode(engine, 2, 8, 16, random.Random(0), skip=1, steps=3, backend_factory=cpu_only))
        # too few decode steps to fill the window: the closing prefill ends it with what it saw
        short = asyncio.run(probe_decode(engine, 1, 8, 4, random.Random(1), skip=0, steps=50, backend_factory=cpu_only))
    finally:
        engine.shutdown()
    assert full["profiled"] and full["steps"] == 3 and full["closed_by"] == "full" and full["mean_batch_size"] == 2
    assert full["profiler"] == "torch.profiler CPU" and full["wall_ms_per_step"] > 0
    assert full["kernels_per_step"] is None and "no kernel events in 3 decode steps" in full["reason"]
    assert short["profiled"] and short["closed_by"] == "non-decode step" and short["steps"] == 4 - 1
    assert short["max_tokens"] == 4


def test_count_triton_compiles_chains_and_restores_the_hook():
    """Every variant Triton builds inside the block is named (from Triton's own hook), a hook already
    installed still runs, and the previous hook is back afterwards."""
    knobs = pytest.importorskip("triton").knobs
    from types import SimpleNamespace

    from vtcore.bench.step_stats import count_triton_compiles

    seen = []
    previous = knobs.runtime.jit_cache_hook
    knobs.runtime.jit_cache_hook = lambda **kw: seen.append(kw["fn"].name)
    try:
        with count_triton_compiles() as names:
            knobs.runtime.jit_cache_hook(fn=SimpleNamespace(name="_gemv_kernel"), key=(), repr="")
            knobs.runtime.jit_cache_hook(fn=SimpleNamespace(name="_decode_kernel"), key=(), repr="")
        assert names == ["_gemv_kernel", "_decode_kernel"] and seen == names
        assert knobs.runtime.jit_cache_hook is not None and knobs.runtime.jit_cache_hook.__name__ == "<lambda>"
    finally:
        knobs.runtime.jit_cache_hook = previous


def test_parameter_bytes_counts_the_active_share_of_routed_experts():
    """A module with ``active_fraction(batch)`` counts its own parameters times that share; its
    children and every other module count whole."""
    import torch

    from vtcore.bench.roofline import parameter_bytes

    class Routed(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w = torch.nn.Parameter(torch.zeros(64, 16))  # 4096 bytes
            self.child = torch.nn.Linear(4, 4, bias=False)  # 64 bytes, not routed

        def active_fraction(self, batch: int) -> float:
            return 1 - (1 - 0.25) ** batch

    model = torch.nn.Sequential(Routed(), torch.nn.Linear(8, 8, bias=False))  # + 256 bytes
    assert parameter_bytes(model) == 4096 + 64 + 256
    assert parameter_bytes(model, 1) == 1024 + 64 + 256
    assert parameter_bytes(model, 2) == round(4096 * 0.4375) + 64 + 256


def test_a_shared_prefix_is_served_from_the_cache_and_reported(tmp_path):
    argv = ["--concurrency", "1", "--num-prompts", "3", "--prefix-len", "16", "--input-len", "8", "--output-len", "4",
            "--copy-mib", COPY_MIB]
    doc, table = _run(tmp_path, argv)
    (run,) = doc["runs"]
    assert doc["prefix_len"] == 16 and doc["prefix_caching"] is True and all(
        r["prompt_tokens"] == 24 for r in run["requests"])
    # the first prompt computes the 16-token prefix (one block); the other two find it
    assert (run["prefix_cache_queries"], run["prefix_cache_hits"]) == (72, 32)
    assert _rows(table)[0][-1] == f"{100 * 32 / 72:.1f}" and "prefix_caching=True" in table.splitlines()[0]
    doc, table = _run(tmp_path, [*argv, "--no-enable-prefix-caching"])
    assert doc["runs"][0]["prefix_cache_hit_rate"] is None and _rows(table)[0][-1] == "-"


def test_prefix_caching_off_and_on_in_one_call(tmp_path):
    doc, table = _run(tmp_path, ["--concurrency", "1", "--num-prompts", "3", "--prefix-len", "16", "--input-len", "8",
                                 "--output-len", "4", "--copy-mib", COPY_MIB, "--compare-prefix-caching"])
    (off,), (on,) = doc["prefix_caching_off"]["runs"], doc["runs"]
    assert doc["prefix_caching"] is True and off["prefix_cache_hit_rate"] is None
    assert on["prefix_cache_hits"] == 32 and on["concurrency"] == off["concurrency"] == 1
    line = next(x for x in table.splitlines() if x.startswith("prefix caching off -> on, c=1"))
    ratio = on["ttft_s"]["median"] / off["ttft_s"]["median"]
    assert f"({ratio:.2f}x)" in line and f"hit rate {100 * 32 / 72:.1f}%" in line


def test_multi_turn_replay_resends_the_conversation(tmp_path):
    doc, _ = _run(tmp_path, ["--concurrency", "1", "--num-prompts", "2", "--turns", "2", "--input-len", "8",
                             "--output-len", "4", "--block-size", "4", "--copy-mib", COPY_MIB])
    (run,) = doc["runs"]
    assert run["turns"] == 2 and [r["prompt_tokens"] for r in run["requests"]] == [8, 20, 8, 20]
    # a second turn finds the first turn's computed full blocks: its 8 prompt tokens (the last output
    # token's KV is never computed, so the block of outputs is not full)
    assert (run["prefix_cache_queries"], run["prefix_cache_hits"]) == (56, 16)


def test_too_many_turns_are_refused_naming_the_flags(tmp_path):
    args = _parser().parse_args(["bench", "--device", "cpu", "--no-progress", "--turns", "40", "--input-len", "8",
                                 "--output-len", "4", "--max-model-len", "128"])
    with pytest.raises(ValueError, match=r"--turns=40 .* reach 480 tokens, over max_model_len=128"):
        args.func(args, io.StringIO())


def test_a_structured_share_is_reported_apart(tmp_path) -> None:
    """--structured-share 0.5: half the requests (interleaved) JSON-schema constrained, each group's
    throughput and TPOT reported apart, adding up to the run's."""
    doc, table = _run(tmp_path, ["--concurrency", "2", "--num-prompts", "4", "--input-len", "8", "--output-len", "40",
                                 "--structured-share", "0.5", "--copy-mib", COPY_MIB])
    (run,) = doc["runs"]
    assert run["structured_share"] == 0.5
    groups = run["groups"]
    assert groups["constrained"]["requests"] == groups["unconstrained"]["requests"] == 2
    # ignore_eos: the plain ones run to max_tokens; the schema's 40 items outlast 40 tokens: so do the held ones
    assert groups["unconstrained"]["output_tokens"] == groups["constrained"]["output_tokens"] == 2 * 40
    jsonschema = pytest.importorskip("jsonschema")
    jsonschema.validate({"values": [7] * 40}, bench_schema(40))
    with pytest.raises(jsonschema.ValidationError):  # a shorter object would end a request before max_tokens
        jsonschema.validate({"values": [7] * 39}, bench_schema(40))
    assert sum(g["output_tokens"] for g in groups.values()) == run["output_tokens"]
    assert [r["constrained"] for r in run["requests"]] == [False, True, False, True]
    assert "c=2 constrained: 2 requests" in table
    with pytest.raises(ValueError, match="--structured-share=1.5: expected a fraction"):
        _run(tmp_path, ["--concurrency", "1", "--structured-share", "1.5", "--copy-mib", COPY_MIB])


def test_a_concurrency_runs_4c_requests_and_at_least_16_unless_asked() -> None:
    from vtcore.bench.summary import MIN_REQUESTS, requests_per_concurrency

    assert MIN_REQUESTS == 16
    assert [requests_per_concurrency(c, None) for c in (1, 4, 5, 128)] == [16, 16, 20, 512]
    assert [requests_per_concurrency(c, n) for c, n in ((1, 4), (8, 3), (2, 7))] == [4, 8, 7]  # at least c
