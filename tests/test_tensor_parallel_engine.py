"""``tensor_parallel_size`` (vLLM's name): the engine runs rank 0 itself and spawns a worker process per other
rank (gloo on the CPU). The tokens equal one rank's, sync, async (the device mirror on rank 0, the step's
ids broadcast, on the general path and the padded one that CUDA graphs replay) and with the mirror off,
for a dense family and a hybrid one resuming cached prefixes from state snapshots; a worker that dies ends
the engine with an error naming it; shutdown leaves no process behind."""
from __future__ import annotations

import json
import multiprocessing
import os
import signal
import time
from typing import Any

import pytest

from vtcore import LLM, SamplingParams
from vtcore.conformance.harness import build_engine, run_engine
from vtcore.worker.tensor_parallel import TensorParallelError

GREEDY = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
KNOBS = dict(device="cpu", block_size=4, num_kv_blocks=96, max_num_seqs=4)


def _arrivals(base: list[int]) -> dict[int, list]:
    sampled = SamplingParams(temperature=1.0, top_p=0.9, seed=3, max_tokens=8, ignore_eos=True)
    return {0: [("a", base, GREEDY), ("b", [7, 3, 1], sampled)], 3: [("c", base[:13] + [9, 9], GREEDY)]}


@pytest.fixture(scope="module")
def hybrid(tmp_path_factory: pytest.TempPathFactory) -> str:
    from vtcore.testing.oracle import hf_model, save_checkpoint
    from vtcore_qwen3_5.plugin import dense_example

    return save_checkpoint(hf_model(dense_example().hf_config, seed=1), str(tmp_path_factory.mktemp("q35")))


@pytest.mark.parametrize("family", ["qwen3", "qwen3_5"])
def test_two_ranks_decode_one_ranks_tokens_sync_async_and_mirror_off(tiny_checkpoint, hybrid, family: str) -> None:
    path = tiny_checkpoint[0] if family == "qwen3" else hybrid
    knobs = {**KNOBS, **({"state_snapshot_interval": 8} if family == "qwen3_5" else {})}
    base = list(range(3, 20))
    one, _ = run_engine(build_engine(path, "sync", **knobs), _arrivals(base))
    runs = {}
    for mode in ("sync", "async", "mirror-off"):
        engine = build_engine(path, mode, **knobs, tensor_parallel_size=2)
        try:
            runs[mode], _ = run_engine(engine, _arrivals(base))
            if family == "qwen3_5":  # request c resumed a cached prefix from a state snapshot on both ranks
                assert engine.requests == {} and engine.pool.hits > 0
            # padded decode steps (CUDA graphs on the GPU) on every rank, as general ones (the gate's prefix-cache
            # check at two ranks requires lone padded chunks)
            assert engine.runner.padded_decode_steps > 0
        finally:
            engine.runner.shutdown()
    greedy = [rid for rid in one if rid != "b"]  # float sums in another order: sampled draws may differ
    assert {r: runs["sync"][r] for r in greedy} == {r: one[r] for r in greedy}
    assert runs["async"] == runs["sync"] == runs["mirror-off"]
    assert not multiprocessing.active_children()


def test_two_ranks_draft_with_a_draft_model_on_the_device(tiny_checkpoint) -> None:
    """A draft model drafting on the device runs on every rank, sharded as the target, after padded verify
    steps (its padded requests included: three rows run at four) as after general ones: rank 0's sampled
    tokens reach the workers' drafters; the target as its own draft has nearly every draft accepted, and
    the tokens are one rank's."""
    path, base = tiny_checkpoint[0], list(range(3, 20))
    spec = {"method": "draft_model", "model": path, "num_speculative_tokens": 3}
    arrivals = {0: [("a", base, GREEDY), ("b", [7, 3, 1], GREEDY)], 3: [("c", base[:13] + [9, 9], GREEDY)]}
    one, _ = run_engine(build_engine(path, "async", **KNOBS, speculative_config=spec), arrivals)
    engine = build_engine(path, "async", **KNOBS, speculative_config=spec, tensor_parallel_size=2)
    try:
        two, _ = run_engine(engine, arrivals)
        assert engine.runner.padded_verify_steps > 0
        assert engine.spec_stats.acceptance_rate > 0.9
    finally:
        engine.runner.shutdown()
    assert two == one
    assert not multiprocessing.active_children()


def test_a_worker_that_dies_ends_the_engine_naming_it_and_nothing_is_left(tiny_checkpoint) -> None:
    """(Two engines of two ranks each run in one process meanwhile.)"""
    llm = LLM(tiny_checkpoint[0], **KNOBS, tensor_parallel_size=2, async_scheduling=False)
    (worker,) = llm.engine.runner.peers.processes
    llm.generate([{"prompt_token_ids": [5, 9, 2]}], GREEDY)
    other = LLM(tiny_checkpoint[0], **KNOBS, tensor_parallel_size=2)  # a second engine of its own ranks
    assert other.generate([{"prompt_token_ids": [5, 9, 2]}], GREEDY)[0].outputs[0].token_ids == \
        llm.generate([{"prompt_token_ids": [5, 9, 2]}], GREEDY)[0].outputs[0].token_ids
    other.engine.runner.shutdown()
    os.kill(worker.pid, signal.SIGKILL)
    worker.join(timeout=10)
    with pytest.raises(TensorParallelError, match=r"worker rank 1 \(pid \d+\) died \(exit code -9\)"):
        llm.generate([{"prompt_token_ids": [5, 9, 2, 4]}], GREEDY)
    llm.engine.runner.shutdown()
    assert not multiprocessing.active_children()


def test_the_cli_takes_the_flag_and_a_bad_size_is_refused(tiny_checkpoint, tmp_path: Any) -> None:
    from vtcore.cli.main import build_parser
    from vtcore.config import EngineConfig
    from vtcore.engine.arg_utils import engine_config_from_args

    for command in ("generate", "serve", "bench"):
        args = build_parser().parse_args([command, "--tensor-parallel-size", "2"] + (["x"] if command == "generate"
                                                                                      else []))
        assert engine_config_from_args(args).tensor_parallel_size == 2
    with pytest.raises(ValueError, match="tensor_parallel_size"):
        EngineConfig(model=tiny_checkpoint[0], tensor_parallel_size=0)
    with pytest.raises(ValueError, match="tensor_parallel_size=2 does not divide"):
        config = json.load(open(os.path.join(tiny_checkpoint[0], "config.json")))
        (tmp_path / "config.json").write_text(json.dumps({**config, "num_attention_heads": 3,
                                                          "num_key_value_heads": 3}))
        LLM(str(tmp_path), **KNOBS, load_format="dummy", tensor_parallel_size=2)
    time.sleep(0.1)
    assert not multiprocessing.active_children()  # the workers of the refused engines were stopped


@pytest.mark.timeout(120)
def test_a_script_without_a_main_guard_fails_at_once_saying_so(tiny_checkpoint, tmp_path) -> None:
    """A spawned worker imports the main module first: a script building the engine at its top level makes the
    worker die while starting. Rank 0 says so at once (it once waited two minutes for a rendezvous, then said
    "Wait timeout")."""
    import subprocess
    import sys

    script = tmp_path / "no_guard.py"
    script.write_text("from vtcore import LLM\n"
                      f"LLM({tiny_checkpoint[0]!r}, tensor_parallel_size=2, device='cpu', max_model_len=64)\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith("VTCORE_")}
    start = time.monotonic()
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=110, env=env,
                          cwd=tmp_path)
    assert proc.returncode != 0
    assert "worker rank 1" in proc.stderr and "before it could join the engine" in proc.stderr, proc.stderr[-2000:]
    assert 'under `if __name__ == "__main__":`' in proc.stderr, proc.stderr[-2000:]
    assert time.monotonic() - start < 60


@pytest.mark.parametrize("fresh", [True, False])
def test_a_worker_dead_before_it_joins_is_named_at_once(fresh: bool) -> None:
    """Rank 0 waits for a worker's word that it joins while watching its process; the main-guard hint is only for
    a new process (a parked one that died was no script's import)."""
    from vtcore.worker.tensor_parallel import _joining, _Worker

    ctx = multiprocessing.get_context("fork")
    ours, theirs = ctx.Pipe()
    process = ctx.Process(target=os._exit, args=(3,))
    process.start()
    theirs.close()
    start = time.monotonic()
    with pytest.raises(TensorParallelError, match=r"worker rank 1 \(pid \d+\) exited \(exit code 3\) before it "
                                                  r"could join the engine") as exc:
        _joining(1, _Worker(process, ours, "cpu", fresh=fresh))
    assert ("__main__" in str(exc.value)) == fresh and time.monotonic() - start < 10

