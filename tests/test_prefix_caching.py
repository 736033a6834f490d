"""Prefix caching: the block pool's hashes, reference counts and eviction order, and the engine reusing
cached prefixes with the same tokens as without, sync and async, under preemption."""
from __future__ import annotations

import hashlib
import random
import sys

import pytest

from vtcore import SamplingParams
from vtcore.conformance.harness import build_engine, run_engine
from vtcore.engine.block_pool import BlockPool

BS = 4
KNOBS = dict(device="cpu", block_size=BS, num_kv_blocks=200, max_num_seqs=8)


def greedy(n: int = 6, **kw) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True, **kw)


# ----------------------------------------------------------------------------------------- the pool

def test_pool_finds_the_longest_cached_chain_and_counts_references() -> None:
    pool = BlockPool(8, BS, caching=True)
    tokens = list(range(12))
    blocks: list[int] = []
    assert pool.grow(blocks, 12) and len(blocks) == 3
    hashes = pool.hashes(tokens, [], 3)
    pool.cache(blocks, hashes)
    other = pool.hashes(tokens[:8] + [99, 98, 97, 96], [], 3)
    assert other[:2] == hashes[:2] and other[2] != hashes[2]  # a hash chains its parent's
    assert pool.match(other) == blocks[:2]  # in use by the first owner too: shared
    pool.free(blocks)  # the first owner leaves: the shared two stay referenced
    assert pool.num_free == 8 - 2
    assert pool.hashes(tokens, [], 3) == hashes
    salted = BlockPool(8, BS, caching=True, salt=b"bfloat16|nvfp4")
    assert salted.hashes(tokens, [], 1) != hashes[:1]  # the salt keys what else makes the KV


def test_block_hashes_are_the_sha256_chain_and_extend_where_they_stopped() -> None:
    pool = BlockPool(8, BS, caching=True, salt=b"s")
    tokens = [random.Random(1).randrange(-2**40, 2**40) for _ in range(5 * BS + 2)]
    parent, want = b"s", []
    for i in range(5):
        parent = hashlib.sha256(parent + b"".join(t.to_bytes(8, sys.byteorder, signed=True)
                                                  for t in tokens[i * BS:(i + 1) * BS])).digest()
        want.append(parent)
    assert pool.hashes(tokens, [], 5) == want
    known = pool.hashes(tokens, [], 2)
    assert pool.hashes(tokens, known, 5) is known and known == want  # extended in place
    assert pool.hashes(tokens, known, 3) == want  # already long enough: unchanged
    many = [t % 1000 for t in tokens] * 4  # past one packed piece of blocks
    assert pool.hashes(many, [], len(many) // BS) == pool.hashes(many, pool.hashes(many, [], 3), len(many) // BS)
    small = BlockPool(2, BS, caching=True, salt=b"s")  # a memo of two digests, evicted on the way
    assert small.hashes(tokens, [], 5) == want and small.hashes(tokens, [], 5) == want


def test_a_hit_lookup_takes_its_cached_blocks_digests_from_the_memo(monkeypatch: pytest.MonkeyPatch) -> None:
    pool = BlockPool(16, BS, caching=True)
    tokens = list(range(11 * BS))
    other = tokens[:9 * BS] + [7] * 2 * BS  # the first 9 blocks shared
    want, want_other = pool.hashes(tokens, [], 11), BlockPool(16, BS, caching=True).hashes(other, [], 11)
    blocks: list[int] = []
    pool.grow(blocks, 10 * BS)
    pool.cache(blocks, want[:10])
    calls = []
    real = hashlib.sha256
    monkeypatch.setattr(hashlib, "sha256", lambda data: calls.append(data) or real(data))
    assert pool.hashes(tokens, [], 11, until_uncached=True) == want  # (block 10 hashed too: not cached)
    assert calls == []  # every digest from the memo
    assert pool.hashes(other, [], 11) == want_other
    assert len(calls) == 2  # only the two new blocks' digests computed


def test_a_lookup_takes_a_whole_cached_piece_of_blocks_hashes_at_once_the_second_time() -> None:
    """A lookup whose 8-block piece was wholly cached before takes the piece's hashes by its parent and ids at
    once (no block digest); the piece's last block evicted, the lookup ends with that piece; the pieces kept are
    bounded (a pool's blocks / 8), least recently used first out."""
    pool = BlockPool(24, BS, caching=True)
    tokens = list(range(20 * BS + 1))
    want = pool.hashes(tokens, [], 20)
    blocks: list[int] = []
    pool.grow(blocks, 20 * BS)
    pool.cache(blocks, want)
    digests = []
    real = pool._digest
    pool._digest = lambda data: digests.append(data) or real(data)
    assert pool.hashes(tokens, [], 20, until_uncached=True) == want and len(digests) == 20
    digests.clear()
    assert pool.hashes(tokens, [], 20, until_uncached=True) == want
    assert len(digests) == 4  # pieces 0-7 and 8-15 at once; 16-19 is no whole piece
    first = list(blocks)
    pool.free(blocks)  # cached, tails first: block 19 the least recently freed, block 0 the most
    taken: list[int] = []
    pool.grow(taken, 13 * BS)  # 4 plain blocks, then 9 cached ones evicted, blocks 19 .. 11
    digests.clear()
    lookup = pool.hashes(tokens, [], 20, until_uncached=True)
    found = pool.match(lookup)
    assert lookup == want[:16] and found == first[:11] and digests == []
    assert list(pool._pieces.values()) == [tuple(want[:8]), tuple(want[8:16])]
    pool.free(found)
    pool.free(taken)
    for other in range(2):  # two more pieces: one evicts the least recently used (the first block's piece)
        moved = [t + 1000 * (other + 1) for t in tokens[:8 * BS]]
        hashes = pool.hashes(moved, [], 8)
        spare: list[int] = []
        pool.grow(spare, 8 * BS)
        pool.cache(spare, hashes)
        assert pool.hashes(moved, [], 8, until_uncached=True) == hashes
    assert len(pool._pieces) == 3 and tuple(want[:8]) not in pool._pieces.values()


def test_a_lookup_hashes_up_to_its_first_uncached_block_and_the_rest_follow_later() -> None:
    pool = BlockPool(16, BS, caching=True)
    tokens = list(range(11 * BS))
    want = pool.hashes(tokens, [], 11)
    lookup = pool.hashes(tokens, [], 11, until_uncached=True)
    assert lookup == want[:1] and pool.match(lookup) == []  # nothing cached: one hash
    blocks: list[int] = []
    pool.grow(blocks, 10 * BS)
    pool.cache(blocks, want[:10])
    lookup = pool.hashes(tokens, [], 11, until_uncached=True)
    assert lookup == want[:11] and pool.match(lookup) == blocks  # the miss at block 10 ends it, past a piece
    partial = pool.hashes(tokens[:4 * BS] + [-1] * 7 * BS, [], 11, until_uncached=True)
    assert partial[:4] == want[:4] and len(partial) == 5  # the first block that differs is the last hashed
    assert pool.hashes(tokens, lookup[:5], 11) == want  # registration extends a lookup's hashes


def test_freed_cached_blocks_stay_findable_until_handed_out_tails_first() -> None:
    pool = BlockPool(4, BS, caching=True)
    a: list[int] = []
    pool.grow(a, 12)
    hashes = pool.hashes(list(range(12)), [], 3)
    pool.cache(a, hashes)
    first = list(a)
    pool.free(a)
    assert pool.num_free == 4 and pool.usage == 0.0
    b: list[int] = []
    pool.grow(b, 4)  # the one never-cached block goes first
    found = pool.match(hashes)
    assert b[0] not in first and found == first
    pool.free(found)  # free again, as a request's blocks are: last block first
    c: list[int] = []
    pool.grow(c, 4)  # then the last block freed, the tail of the prefix: its chain now ends earlier
    assert c == [first[2]] and pool.match(hashes) == first[:2]
    pool.reset()
    assert pool.match(hashes) == []


def test_one_grow_hands_out_plain_blocks_most_recently_freed_first_then_evicts_cached_ones() -> None:
    """The hand-out order: never-cached free blocks first (the last freed first), then cached ones least recently
    freed first, each evicted (no longer findable); after a reset the formerly cached free blocks follow the others."""
    pool = BlockPool(8, BS, caching=True)
    a: list[int] = []
    pool.grow(a, 3 * BS)
    assert a == [0, 1, 2]
    hashes = pool.hashes(list(range(3 * BS)), [], 3)
    pool.cache(a, hashes)
    plain: list[int] = []
    pool.grow(plain, 2 * BS)
    pool.free(a)  # cached: tails first into the LRU (2, 1, 0)
    pool.free(plain)  # plain, last block first: block 3 on top
    b: list[int] = []
    assert pool.grow(b, 6 * BS) and b == [3, 4, 5, 6, 7, 2]
    found = pool.match(hashes)
    assert found == [0, 1] and pool.num_free == 0
    assert not pool.grow(b, 7 * BS) and len(b) == 6  # short: no change
    pool.free(b)
    pool.free(found)  # cached again: 1, then 0
    pool.reset()
    c: list[int] = []
    pool.grow(c, 8 * BS)
    assert c == [3, 4, 5, 6, 7, 2, 1, 0] and pool.match(hashes) == []


# ----------------------------------------------------------------------------------------- the engine

def _prompt(n: int, seed: int = 0) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 500) for _ in range(n)]


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_shared_prefixes_reuse_blocks_and_keep_the_tokens(tiny_checkpoint, mode: str) -> None:
    base = _prompt(4 * BS + 2)
    prompts = {  # (prompt, prompt tokens found in the cache when sent after "base" finished)
        "short": (base[:BS - 1] + [7, 8], 0),  # shares less than a block
        "block": (base[:BS] + [7], BS),  # exactly one block
        "exact": (base[:2 * BS], BS),  # equal to a two-block prefix: its last token is computed
        "many": (base[:4 * BS + 1] + [9, 9, 9], 4 * BS),  # many blocks and a partial one
        "same": (base, 4 * BS),
        "other": (_prompt(3 * BS, seed=1), 0),
    }
    on = build_engine(tiny_checkpoint[0], mode, **KNOBS)
    off = build_engine(tiny_checkpoint[0], mode, **KNOBS, enable_prefix_caching=False)
    assert on.pool.caching and not off.pool.caching
    arrivals = {0: [("base", base, greedy(8))]}
    arrivals[12] = [(rid, p, greedy()) for rid, (p, _) in prompts.items()]
    got, want = _outputs(on, arrivals), _outputs(off, arrivals)
    assert {r: o.outputs[0].token_ids for r, o in got.items()} == {r: o.outputs[0].token_ids for r, o in want.items()}
    assert {r: o.num_cached_tokens for r, o in got.items()} == {"base": 0, **{r: n for r, (_, n) in prompts.items()}}
    assert on.stats().prefix_cache_hits > 0 and off.stats().prefix_cache_queries == 0


def _outputs(engine, arrivals) -> dict:
    """Each request's final RequestOutput when ``arrivals`` run on ``engine`` (after a reset of its cache)."""
    engine.reset_prefix_cache()
    outs = {}
    call = 0
    while call <= max(arrivals) or engine.has_unfinished_requests():
        for rid, ids, params in arrivals.get(call, []):
            engine.add_request(rid, {"prompt_token_ids": ids}, params)
        outs.update({o.request_id: o for o in engine.step() if o.finished})
        call += 1
    return outs


def test_a_new_prompt_is_hashed_to_its_first_miss_before_its_step_and_the_rest_after(tiny_checkpoint, monkeypatch
                                                                                     ) -> None:
    eng = build_engine(tiny_checkpoint[0], "async", **KNOBS)
    eng.add_request("a", {"prompt_token_ids": _prompt(10 * BS + 1, seed=3)}, greedy(2))
    req = eng.requests["a"]
    hashed_at_submit = []
    submit = eng.runner.submit
    monkeypatch.setattr(eng.runner, "submit", lambda batch: (hashed_at_submit.append(len(req.block_hashes)),
                                                             submit(batch))[1])
    eng.step()
    assert hashed_at_submit == [1] and len(req.block_hashes) == 10  # the lookup's one, then registered after


def test_a_request_arriving_while_the_first_runs_hits_its_prompt_blocks(tiny_checkpoint) -> None:
    eng = build_engine(tiny_checkpoint[0], "async", **KNOBS)
    base = _prompt(3 * BS + 1, seed=2)
    outs = _outputs(eng, {0: [("first", base, greedy(20))], 2: [("second", base[:3 * BS] + [5, 6], greedy())]})
    assert outs["second"].num_cached_tokens == 3 * BS and outs["first"].num_cached_tokens == 0


def test_prompt_logprobs_requests_compute_their_whole_prompt(tiny_checkpoint) -> None:
    eng = build_engine(tiny_checkpoint[0], "sync", **KNOBS)
    base = _prompt(3 * BS)
    want = _outputs(build_engine(tiny_checkpoint[0], "sync", **KNOBS, enable_prefix_caching=False),
                    {0: [("lp", base, greedy(prompt_logprobs=1))]})["lp"]
    outs = _outputs(eng, {0: [("warm", base, greedy())], 10: [("lp", base, greedy(prompt_logprobs=1))]})
    assert outs["lp"].num_cached_tokens == 0 and outs["lp"].prompt_logprobs == want.prompt_logprobs


def test_sync_and_async_build_the_same_batches_with_caching_under_preemption(tiny_checkpoint) -> None:
    prefix = _prompt(2 * BS + 1, seed=3)
    arrivals: dict[int, list] = {}
    for i in range(10):
        arrivals.setdefault(i // 2, []).append((f"r{i}", prefix[:BS * (1 + i % 3)] + _prompt(3 + i, seed=10 + i),
                                                greedy(6 + i % 4)))
    knobs = {**KNOBS, "num_kv_blocks": 14, "max_num_batched_tokens": 12}
    sync = build_engine(tiny_checkpoint[0], "sync", **knobs)
    sync_tokens, sync_batches = run_engine(sync, arrivals)
    asyn = build_engine(tiny_checkpoint[0], "async", **knobs)
    assert run_engine(asyn, arrivals) == (sync_tokens, sync_batches)
    assert sync.scheduler.num_preemptions > 0 and sync.stats().prefix_cache_hits > 0
    off = build_engine(tiny_checkpoint[0], "sync", **knobs, enable_prefix_caching=False)
    assert run_engine(off, arrivals)[0] == sync_tokens
    assert sync.pool.num_free == sync.pool.num_blocks


def test_the_knob_is_a_flag_on_every_command_and_reset_forgets(tiny_checkpoint) -> None:
    import argparse

    from vtcore.engine.arg_utils import add_engine_args, engine_config_from_args

    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    assert engine_config_from_args(parser.parse_args(["--no-enable-prefix-caching"])).enable_prefix_caching is False
    assert engine_config_from_args(parser.parse_args([])).enable_prefix_caching is True
    from vtcore import LLM

    llm = LLM(tiny_checkpoint[0], **KNOBS)
    prompt = {"prompt_token_ids": _prompt(3 * BS, seed=5)}
    llm.generate(prompt, greedy())
    assert llm.generate(prompt, greedy())[0].num_cached_tokens == 2 * BS
    assert llm.reset_prefix_cache() is True
    assert llm.generate(prompt, greedy())[0].num_cached_tokens == 0


@pytest.mark.parametrize("arrive", [1, 2, 3])
def test_sync_and_async_register_a_block_filled_by_an_output_at_the_same_step(tiny_checkpoint, arrive: int) -> None:
    """The first output token completes a block; a request resending prompt and that token arrives one,
    two or three steps later. The host learns the token a step later in the async engine, so a rule on
    the tokens the host has seen would register the block at different steps in the two engines."""
    prompt = _prompt(2 * BS - 1, seed=7)
    first = run_engine(build_engine(tiny_checkpoint[0], "sync", **KNOBS), {0: [("a", prompt, greedy(8))]})[0]["a"]
    arrivals = {0: [("a", prompt, greedy(8))], arrive: [("b", prompt + first[:1] + [3, 4], greedy(4))]}
    sync = run_engine(build_engine(tiny_checkpoint[0], "sync", **KNOBS), arrivals)
    assert run_engine(build_engine(tiny_checkpoint[0], "async", **KNOBS), arrivals) == sync


def test_a_cache_salt_shares_blocks_only_with_its_own_salt(tiny_checkpoint) -> None:
    """vLLM's ``cache_salt`` in a prompt dict: a salted prompt finds no block of an unsalted one nor of another
    salt, and all of its own salt's; the tokens are those of an uncached run. A salt that is not a non-empty
    string is refused, naming it."""
    from vtcore import LLM

    llm = LLM(tiny_checkpoint[0], **KNOBS)
    ids = _prompt(4 * BS + 1, seed=9)
    want = llm.generate({"prompt_token_ids": ids}, greedy())[0].outputs[0].token_ids
    cached = {}
    for name, salt in (("salted", "alice"), ("same salt", "alice"), ("other salt", "bob"), ("unsalted", None),
                       ("n=2, same salt", "alice")):
        params = SamplingParams(max_tokens=6, temperature=1.0, top_k=1, ignore_eos=True, n=2) \
            if name.startswith("n=2") else greedy()  # (n > 1 samples: top-k 1 is greedy's tokens)
        out = llm.generate({"prompt_token_ids": ids, "cache_salt": salt}, params)[0]
        assert [o.token_ids for o in out.outputs] == [want] * params.n, name
        cached[name] = out.num_cached_tokens
    assert cached == {"salted": 0, "same salt": 4 * BS, "other salt": 0, "unsalted": 4 * BS,
                      "n=2, same salt": 4 * BS}
    for bad in ("", 7, "a\ud800"):  # (a lone surrogate has no UTF-8 to hash: it once killed the step)
        with pytest.raises(ValueError, match="cache_salt"):
            llm.generate({"prompt_token_ids": ids, "cache_salt": bad}, greedy())
    assert llm.generate({"prompt_token_ids": ids, "cache_salt": "alice"}, greedy())[0].num_cached_tokens == 4 * BS
