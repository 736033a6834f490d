"""vLLM's priority scheduling (``scheduling_policy="priority"``): waiting requests are admitted by (priority,
arrival), running ones are scheduled in that order and the lowest-priority newest one is preempted when the
KV pool runs short; tokens are those of first-come-first-served, and sync and async build the same batches.
Under the default policy a priority other than 0 is refused, naming it."""
from __future__ import annotations

import argparse
import random
from typing import Any

import pytest

from vtcore import LLM, SamplingParams
from vtcore.conformance.harness import build_engine, run_engine

KNOBS = dict(device="cpu", block_size=4, num_kv_blocks=200)


def greedy(n: int) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)


def _ids(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 500) for _ in range(n)]


def _first_scheduled(batches: list[list[tuple[str, int, int]]]) -> list[str]:
    order: list[str] = []
    for batch in batches:
        order += [rid for rid, _, _ in batch if rid not in order]
    return order


@pytest.mark.parametrize("policy, want", [("priority", ["b", "c", "a"]), ("fcfs", ["a", "b", "c"])])
def test_waiting_requests_are_admitted_by_priority_then_arrival(tiny_checkpoint, policy: str, want: list[str]) -> None:
    eng = build_engine(tiny_checkpoint[0], "sync", **KNOBS, max_num_seqs=1, scheduling_policy=policy)
    ranks = {"a": 5, "b": -1, "c": 2} if policy == "priority" else {"a": 0, "b": 0, "c": 0}
    arrivals = {0: [(rid, _ids(6, i), greedy(3), ranks[rid]) for i, rid in enumerate("abc")]}
    tokens, batches = run_engine(eng, arrivals)
    if policy == "priority":  # equal priorities keep arrival order
        tied = build_engine(tiny_checkpoint[0], "sync", **KNOBS, max_num_seqs=1, scheduling_policy=policy)
        assert _first_scheduled(run_engine(tied, {0: [(*row[:3], 3) for row in arrivals[0]]})[1]) == ["a", "b", "c"]
    assert _first_scheduled(batches) == want
    alone = build_engine(tiny_checkpoint[0], "sync", **KNOBS)
    assert tokens == run_engine(alone, {0: [(rid, ids, p) for rid, ids, p, _ in arrivals[0]]})[0]


def _preempted(eng: Any) -> list[str]:
    """Record the requests ``eng``'s scheduler preempts, in order."""
    seen: list[str] = []
    preempt = eng.scheduler._preempt

    def recorded(req: Any) -> None:
        seen.append(req.request_id)
        preempt(req)
    eng.scheduler._preempt = recorded
    return seen


def test_a_short_pool_preempts_the_lowest_priority_request_and_both_engines_agree(tiny_checkpoint) -> None:
    """Three requests outgrow a small pool; the oldest has the lowest priority (the largest value), so it is
    the one preempted (first come, first served would preempt the newest). Sync and async schedule the same
    batches, and every request's tokens are the ones it gets alone."""
    knobs = {**KNOBS, "num_kv_blocks": 12, "max_num_seqs": 3, "scheduling_policy": "priority"}
    arrivals = {0: [("low", _ids(6, 1), greedy(14), 9)], 1: [("mid", _ids(6, 2), greedy(14), 1)],
                2: [("high", _ids(6, 3), greedy(14), 0)]}
    runs = {}
    for mode in ("sync", "async"):
        eng = build_engine(tiny_checkpoint[0], mode, **knobs)
        seen = _preempted(eng)
        runs[mode] = run_engine(eng, arrivals)
        assert seen and set(seen) == {"low"}, (mode, seen)
        assert eng.pool.num_free == eng.pool.num_blocks
    assert runs["async"] == runs["sync"]
    fcfs = build_engine(tiny_checkpoint[0], "sync", **{**knobs, "scheduling_policy": "fcfs"})
    seen = _preempted(fcfs)
    plain = {t: [(rid, ids, p) for rid, ids, p, _ in rows] for t, rows in arrivals.items()}
    assert run_engine(fcfs, plain)[0] == runs["sync"][0]
    assert seen and "low" not in seen  # the newest go first there


def test_priority_needs_the_priority_policy_and_an_integer(tiny_checkpoint) -> None:
    llm = LLM(tiny_checkpoint[0], **KNOBS)
    prompt = {"prompt_token_ids": _ids(5, 7)}
    for bad, match in ((1, "scheduling_policy='priority'"), (True, "expected an integer"),
                       ("1", "expected an integer")):
        with pytest.raises(ValueError, match="priority="):
            llm.generate(prompt, greedy(2), priority=[bad])
        with pytest.raises(ValueError, match=match):
            llm.engine.add_request("x", prompt, greedy(2), bad)
    assert not llm.engine.has_unfinished_requests()
    with pytest.raises(ValueError, match="priority has 2 entries"):
        llm.generate(prompt, greedy(2), priority=[0, 0])
    with pytest.raises(ValueError, match="priority=3: expected a list"):
        llm.generate(prompt, greedy(2), priority=3)
    assert llm.generate(prompt, greedy(2), priority=[0])[0].outputs[0].token_ids
    with pytest.raises(ValueError, match="scheduling_policy='lifo'"):
        LLM(tiny_checkpoint[0], **KNOBS, scheduling_policy="lifo")
    from vtcore.engine.arg_utils import add_engine_args, engine_config_from_args

    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    assert engine_config_from_args(parser.parse_args(["--scheduling-policy", "priority"])).scheduling_policy \
        == "priority"
    assert engine_config_from_args(parser.parse_args([])).scheduling_policy == "fcfs"
