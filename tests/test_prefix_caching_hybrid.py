"""Prefix caching of a hybrid family (Qwen3.5's Gated DeltaNet layers keep per-request state): the
snapshot pool's order, and the engine resuming cached prefixes from state snapshots with the same
tokens as without caching, sync and async, chunked, preempted and with the pool short."""
from __future__ import annotations

import json
import logging
import random

import pytest

from vtcore import SamplingParams
from vtcore.conformance.harness import build_engine, run_engine
from vtcore.engine.snapshot_pool import SnapshotPool
from vtcore.errors import ConfigError
from vtcore.layers.gated_deltanet import GatedDeltaNet

BS = 4
KNOBS = dict(device="cpu", block_size=BS, num_kv_blocks=200, max_num_seqs=8, load_format="dummy",
             state_snapshot_interval=2 * BS)


def greedy(n: int = 6) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)


def _prompt(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(512) for _ in range(n)]


@pytest.fixture(scope="module")
def hybrid(tmp_path_factory) -> str:
    from vtcore_qwen3_5.plugin import dense_example

    path = tmp_path_factory.mktemp("qwen3_5")
    (path / "config.json").write_text(json.dumps(dense_example().hf_config))
    return str(path)


# ------------------------------------------------------------------------------------ the snapshot pool

def test_snapshot_pool_finds_registered_evicts_least_recently_used_and_reuses_released_first() -> None:
    pool = SnapshotPool(3, 8)
    a, b, c = pool.take(), pool.take(), pool.take()
    assert pool.take() is None  # every slot waits for its registration
    pool.register(a, b"A")
    pool.register(b, b"B")
    pool.release(c)  # its request left before registering it: handed out first
    assert pool.take() == c
    assert pool.find(b"A") == a  # A is now the most recently used: B goes first
    pool.register(c, b"A")  # a duplicate of a cached snapshot is handed back, not cached twice
    assert pool.find(b"A") == a and pool.take() == c
    assert pool.take() == b and pool.find(b"B") is None
    pool.reset()
    assert pool.find(b"A") is None and pool.take() == a


# ------------------------------------------------------------------------------------------ the engine

def _arrivals() -> dict[int, list]:
    """A first request, then followers sharing 8, 16, 19 and all 21 of its prompt tokens, while it runs
    and after; and one whose last computed token ends a snapshot it leaves before registering."""
    base = _prompt(21, seed=1)
    return {0: [("first", base, greedy(8)), ("short", _prompt(7, seed=5), greedy(2))],
            2: [("share-8", base[:8] + _prompt(5, seed=2), greedy()), ("share-19", base[:19] + _prompt(3, 3), greedy())],
            14: [("share-16", base[:16] + _prompt(2, seed=4), greedy()), ("again", base, greedy())]}


def _run(path: str, mode: str, **knobs) -> tuple[dict, list, object]:
    engine = build_engine(path, mode, **{**KNOBS, **knobs})
    tokens, batches = run_engine(engine, _arrivals())
    return tokens, batches, engine


@pytest.mark.parametrize("knobs", [{}, {"max_num_batched_tokens": 8}, {"num_kv_blocks": 12},
                                   {"num_state_snapshots": 1}],
                         ids=["whole-prompts", "chunked-at-blocks", "preempting", "one-snapshot"])
def test_cached_prefixes_resume_from_snapshots_with_the_tokens_of_no_caching_sync_and_async(hybrid, knobs) -> None:
    off, _, _ = _run(hybrid, "sync", enable_prefix_caching=False, **knobs)
    tokens, batches, engine = _run(hybrid, "sync", **knobs)
    assert tokens == off and engine.pool.caching
    if "num_state_snapshots" not in knobs:  # one slot: each new snapshot evicts the last before it is found
        assert engine.stats().prefix_cache_hits > 0
    async_tokens, async_batches, _ = _run(hybrid, "async", **knobs)
    assert (async_tokens, async_batches) == (tokens, batches)
    if "num_kv_blocks" in knobs:
        assert engine.scheduler.num_preemptions > 0
    snapshots = engine.scheduler.snapshots
    assert snapshots.num_free == snapshots.num_slots  # every taken slot registered or handed back


def test_a_hit_resumes_only_where_a_snapshot_ends_its_prefix(hybrid) -> None:
    engine = build_engine(hybrid, "sync", **KNOBS)
    base = _prompt(21, seed=1)
    run_engine(engine, {0: [("first", base, greedy(2))]})
    seen: dict[str, int] = {}

    def admitted(batch) -> None:
        for s in batch:
            seen.setdefault(s.request.request_id, s.request.num_cached_tokens)

    # 19 shared tokens match 4 blocks (16 tokens), and a snapshot every 8 tokens ends at 16; 13 shared
    # tokens match 3 blocks, cut back to the snapshot at 8
    run_engine(engine, {0: [("a", base[:19] + [7, 7], greedy(2))], 1: [("b", base[:13] + [9, 9, 9], greedy(2))]},
               admitted)
    assert seen == {"a": 16, "b": 8}


def test_a_stateful_layer_that_cannot_snapshot_turns_caching_off_said_once(hybrid, caplog, monkeypatch) -> None:
    monkeypatch.setattr(GatedDeltaNet, "supports_state_snapshots", False)
    with caplog.at_level(logging.WARNING, logger="vtcore"):
        first = build_engine(hybrid, "sync", **KNOBS)
        build_engine(hybrid, "sync", **KNOBS)
    assert not first.pool.caching and first.runner.num_state_snapshots == 0
    said = [r.getMessage() for r in caplog.records if "prefix caching is off" in r.getMessage()]
    assert len(said) <= 1 and all("GatedDeltaNet" in m and "supports_state_snapshots" in m for m in said)


def test_the_snapshot_interval_must_end_blocks(hybrid) -> None:
    with pytest.raises(ConfigError, match=r"state_snapshot_interval=6: expected a multiple of block_size=4"):
        build_engine(hybrid, "sync", **{**KNOBS, "state_snapshot_interval": 6})


def test_the_cuda_memory_budget_is_read_after_dead_engines_are_collected(hybrid, monkeypatch) -> None:
    """A second engine in one process (``vtcore bench --compare-prefix-caching``) sized its caches while
    the first one's memory, held in reference cycles, was not yet freed."""
    import gc
    import weakref

    import torch

    engine = build_engine(hybrid, "sync", **KNOBS)
    runner = engine.runner

    class Cycle:
        pass

    dead = Cycle()
    dead.me = dead
    alive = weakref.ref(dead)
    del dead
    seen = []
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device: (seen.append(alive()), (3 << 30, 4 << 30))[1])
    monkeypatch.setattr(runner, "device", torch.device("cuda"))
    gc.disable()
    try:
        assert runner._memory_budget(0.5) == (2 << 30) - (1 << 30)
    finally:
        gc.enable()
    assert seen == [None]
