"""A group of one rank (``vtcore.layers.parallel.TensorParallel.collective``): the engine built over it runs
every collective of the tensor-parallel path (the embedding's and each row-parallel layer's all-reduce, the
logits' all-gather, the step's ids broadcast) through that group, and decodes one plain rank's tokens. On the
CPU the group is gloo's; on a GPU it is NCCL's and the collectives sit inside the captured CUDA graphs, which
is the part of a multi-GPU run that one GPU can run."""
from __future__ import annotations

import collections
from typing import Any

import pytest
import torch

from vtcore.conformance.harness import build_engine, run_engine
from vtcore.engine import llm_engine
from vtcore.worker.tensor_parallel import _groups
from vtcore import SamplingParams

GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=2)
COLLECTIVES = ("allreduce", "allgather", "broadcast")


class CountedGroup:
    """A process group whose collectives are counted by name, and apart those made while a CUDA graph is captured
    (each then runs at every replay)."""

    def __init__(self, group: Any) -> None:
        self.group, self.calls, self.captured = group, collections.Counter(), collections.Counter()

    def __getattr__(self, name: str) -> Any:
        method = getattr(self.group, name)
        if name not in COLLECTIVES:
            return method

        def counted(*args: Any, **kwargs: Any) -> Any:
            self.calls[name] += 1
            self.captured[name] += torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()
            return method(*args, **kwargs)
        return counted


def _arrivals() -> dict[int, list]:
    base = list(range(3, 24))
    return {0: [("a", base, GREEDY), ("b", [7, 3, 1], GREEDY)], 2: [("c", base[:9] + [9, 9], GREEDY)]}


def _logprobs(finals: dict) -> dict[str, list[dict[int, float]]]:
    return {rid: [{t: lp.logprob for t, lp in step.items()} for step in out.logprobs] for rid, out in finals.items()}


def _one_rank_run(path: str, store: str, device: str, mode: str, monkeypatch: pytest.MonkeyPatch, finals: dict,
                  **knobs: Any) -> tuple[dict, CountedGroup, Any]:
    group = CountedGroup(_groups(0, 1, store, device)[0])
    real = llm_engine.tensor_parallel
    with monkeypatch.context() as m:  # (the engine's own ``tensor_parallel(0, 1, None)`` gets the group)
        m.setattr(llm_engine, "tensor_parallel", lambda rank, size, g: real(rank, size, group if g is None else g))
        engine = build_engine(path, mode, device=device, **knobs)
    try:
        tokens, _ = run_engine(engine, _arrivals(), finals=finals)
    finally:
        engine.runner.shutdown()
    return tokens, group, engine


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_a_one_rank_gloo_group_runs_every_collective_and_decodes_one_ranks_tokens(tiny_checkpoint, tmp_path,
                                                                                  monkeypatch, mode: str) -> None:
    path, hf = tiny_checkpoint
    knobs = dict(dtype="float32", block_size=4, num_kv_blocks=64, max_num_seqs=4)
    plain_finals, finals = {}, {}
    plain, _ = run_engine(build_engine(path, mode, device="cpu", **knobs), _arrivals(), finals=plain_finals)
    tokens, group, engine = _one_rank_run(path, str(tmp_path / "store"), "cpu", mode, monkeypatch, finals, **knobs)
    assert tokens == plain and _logprobs(finals) == _logprobs(plain_finals)
    assert engine.runner.padded_decode_steps > 0  # the padded path's broadcast ran as well as the general one's
    forwards, rest = divmod(group.calls["allreduce"], 1 + 2 * hf.config.num_hidden_layers)  # embedding, o and down
    assert forwards > 0 and rest == 0, group.calls
    assert 0 < group.calls["allgather"] <= forwards and group.calls["broadcast"] > 0, group.calls


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_a_one_rank_nccl_group_runs_inside_the_cuda_graphs(tiny_checkpoint, tmp_path, monkeypatch) -> None:
    """The collectives are captured (counted while a graph is captured, then replayed with no Python call); the
    tokens are the oracle's (the row-parallel layers skip the fused-norm GEMV, so bits may differ from a plain
    rank's near ties)."""
    from vtcore.testing.oracle import near_tie_violations

    path, hf = tiny_checkpoint
    tokens, group, engine = _one_rank_run(path, str(tmp_path / "store"), "cuda", "async", monkeypatch, {},
                                          dtype="float32", max_num_seqs=4)
    assert engine.runner.graph_replays > 0
    assert all(group.captured[c] > 0 for c in COLLECTIVES), (group.captured, group.calls)
    for rid, (prompt, _) in {r: (p, s) for step in _arrivals().values() for r, p, s in step}.items():
        assert not near_tie_violations(hf, prompt, tokens[rid]), rid
