"""The gate at ``tensor_parallel_size=2`` (engines of two ranks, a worker process over gloo): it catches what only
shows above one rank (a family's own norm that neither shards nor declares itself replicated, refused by name; a
row-parallel layer that loads rank 0's part on every rank), the CLI takes the flag (the quant section too: FP4
checkpoints split over the ranks), and the workers that serve
one engine after another inside ``reused_workers()`` leave no process behind, also after a step that failed
on rank 0 mid-forward."""
from __future__ import annotations

import io
import json
import multiprocessing
import time
from typing import Any

import pytest

from vtcore.conformance.gate import run_gate


def _statuses(gate: Any, checks: list[str]) -> dict[str, str]:
    return {c: gate.results[c].status for c in checks}


def test_a_norm_of_its_own_that_does_not_declare_how_it_shards_fails_structure_above_one_rank(plugins) -> None:
    (one,) = run_gate(["unsharded_norm"], plugins=plugins, quant=[], checks=["structure"])
    assert one.results["structure"].status == "pass"
    (two,) = run_gate(["unsharded_norm"], plugins=plugins, quant=[], checks=["structure", "oracle-greedy"],
                      tensor_parallel_size=2)
    detail = two.results["structure"].detail
    assert two.results["structure"].status == "fail", detail
    assert "module 'model.norm' (_UndeclaredNorm) owns parameters it does not shard" in detail
    assert two.results["oracle-greedy"].status == "skip"
    assert not multiprocessing.active_children()


def test_a_layer_that_loads_rank_0s_part_on_every_rank_fails_the_oracle_only_above_one_rank(plugins) -> None:
    checks = ["weights", "oracle-greedy", "async-abc"]
    (one,) = run_gate(["rank_zero_o_proj"], plugins=plugins, quant=[], checks=checks)
    assert set(_statuses(one, checks).values()) == {"pass"}, {c: one.results[c].detail for c in checks}
    (two,) = run_gate(["rank_zero_o_proj"], plugins=plugins, quant=[], checks=checks, tensor_parallel_size=2)
    # rank 0's own share is right (weights); async equals sync, wrong alike; the oracle sees it
    assert _statuses(two, checks) == {"weights": "pass", "oracle-greedy": "fail", "async-abc": "pass"}
    assert "greedy tokens differ from transformers:Qwen3ForCausalLM" in two.results["oracle-greedy"].detail
    assert "as rank 0's part of 2" in two.results["weights"].detail
    assert not multiprocessing.active_children()


def test_the_cli_runs_the_gate_on_two_ranks_quant_section_included(tmp_path: Any) -> None:
    from vtcore.cli.main import main

    out = io.StringIO()
    rc = main(["conformance", "--family", "qwen3_dense", "--tensor-parallel-size", "2", "--check", "weights",
               "--quant", "nvfp4-pack-quantized", "--json", str(tmp_path / "r.json")], out=out)
    report = json.loads((tmp_path / "r.json").read_text())
    assert rc == 0, out.getvalue()
    assert "vtcore conformance (device cpu, tensor_parallel_size 2)" in out.getvalue()
    assert report["tensor_parallel_size"] == 2
    assert report["families"]["qwen3_dense"]["checks"]["weights"]["status"] == "pass"
    tokens = report["quant"]["nvfp4-pack-quantized"]["checks"]["tokens"]
    assert (tokens["status"], tokens["detail"]) == ("pass", "qwen3_dense agree with their decoded dense models")
    assert not multiprocessing.active_children()
    with pytest.raises(SystemExit):
        main(["conformance", "--tensor-parallel-size", "0"], out=io.StringIO())


@pytest.mark.parametrize("interrupt", [RuntimeError, KeyboardInterrupt], ids=["error", "ctrl-c"])
def test_workers_serve_one_engine_after_another_and_stop_with_the_context(tiny_checkpoint, interrupt) -> None:
    from vtcore import LLM, SamplingParams
    from vtcore.worker.tensor_parallel import TensorParallelError, reused_workers

    greedy = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    knobs = dict(device="cpu", block_size=4, num_kv_blocks=64, max_num_seqs=4, tensor_parallel_size=2)
    with reused_workers():
        first = LLM(tiny_checkpoint[0], **knobs)
        (pid,) = [p.pid for p in first.engine.runner.peers.processes]
        want = first.generate([{"prompt_token_ids": [5, 9, 2]}], greedy)[0].outputs[0].token_ids
        first.shutdown()
        second = LLM(tiny_checkpoint[0], **knobs, async_scheduling=False)
        assert [p.pid for p in second.engine.runner.peers.processes] == [pid]  # the same process, a new engine
        assert second.generate([{"prompt_token_ids": [5, 9, 2]}], greedy)[0].outputs[0].token_ids == want
        # a step that fails (or is interrupted by Ctrl-C) on rank 0 mid-forward leaves the worker in a
        # collective: it is killed at once
        model, forward = second.engine.runner.model, second.engine.runner.model.forward

        def broken(*args: Any, **kwargs: Any) -> Any:
            raise interrupt("rank 0 broke")

        model.forward = broken
        started = time.monotonic()
        with pytest.raises(interrupt, match="rank 0 broke"):
            second.generate([{"prompt_token_ids": [5, 9]}], greedy)
        model.forward = forward
        with pytest.raises(TensorParallelError,
                           match=rf"a step failed on rank 0 \({interrupt.__name__}: rank 0 broke\)"):
            second.generate([{"prompt_token_ids": [5, 9]}], greedy)
        assert time.monotonic() - started < 30  # not a collective's timeout
        second.shutdown()
        third = LLM(tiny_checkpoint[0], **knobs)  # the killed worker is not reused
        assert [p.pid for p in third.engine.runner.peers.processes] != [pid]
        third.shutdown()
        assert len(multiprocessing.active_children()) == 1  # parked
    assert not multiprocessing.active_children()


def test_a_worker_that_cannot_build_its_share_is_named_before_any_step_and_ranks_share_rank_0s_cache_sizes(
        plugins, tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """The engine waits for every worker's build before the ranks capture graphs together (on CUDA a dead
    worker would leave rank 0 waiting in a collective); the workers size their caches as rank 0 did."""
    from vtcore import LLM
    from vtcore.plugins.manager import use_plugins
    from vtcore.testing.oracle import hf_model, save_checkpoint
    from vtcore.worker.tensor_parallel import Peers, TensorParallelError
    from tests.fixture_async.families import fails_on_rank1_example, rank_zero_o_proj_example

    knobs = dict(device="cpu", block_size=4, max_num_seqs=4, tensor_parallel_size=2)
    bad = save_checkpoint(hf_model(fails_on_rank1_example().hf_config, seed=0,
                                   oracle=fails_on_rank1_example().oracle), str(tmp_path / "bad"))
    good = save_checkpoint(hf_model(rank_zero_o_proj_example().hf_config, seed=0,
                                    oracle=rank_zero_o_proj_example().oracle), str(tmp_path / "good"))
    sent = []
    setup = Peers.setup
    monkeypatch.setattr(Peers, "setup", lambda self, s: (sent.append(s), setup(self, s))[1])
    with use_plugins(plugins):
        with pytest.raises(TensorParallelError, match=r"worker rank 1 \(pid \d+\) died"):
            LLM(bad, **knobs)
        llm = LLM(good, **knobs)  # no num_kv_blocks given: rank 0 sizes the pool, the workers take its size
        llm.shutdown()
    assert sent[-1].runner_config.num_kv_blocks == llm.engine.runner.num_kv_blocks > 0
    assert not multiprocessing.active_children()
