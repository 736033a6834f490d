"""Speculative decoding with the n-gram proposer and draft models (on the host and on the device, hybrid
drafts included): greedy tokens equal plain decoding's (with prefix caching, chunked prefill, preemption,
stops inside an accepted run), sampled tokens keep the target's distribution (chi-square against plain
sampling), and the counters add up."""
from __future__ import annotations

import collections
import random

import pytest
import torch

from vtcore import LLM, SamplingParams
from vtcore.conformance.harness import build_engine, run_engine
from vtcore.config import EngineConfig
from vtcore.errors import VtcoreError
from vtcore.spec.config import SpeculativeConfig
from vtcore.spec.ngram import NgramProposer
from vtcore.spec.proposer import PerSequence

NGRAM = {"method": "ngram", "num_speculative_tokens": 3}
KNOBS = dict(device="cpu", block_size=4, num_kv_blocks=200, max_num_seqs=8)


def greedy(n: int, **kw) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True, **kw)


def _repetitive(n: int, seed: int) -> list[int]:
    """A prompt that repeats a short random phrase, so prompt lookup has something to propose."""
    rng = random.Random(seed)
    phrase = [rng.randrange(500) for _ in range(rng.randrange(3, 7))]
    return (phrase * (n // len(phrase) + 1))[:n]


def test_replay_proposes_what_followed_shorter_and_longer_prefixes() -> None:
    """Sequences are indexed by their first tokens; a prefix shorter than the key is still found."""
    from vtcore.spec.replay import KEY_TOKENS, ReplayProposer

    long = list(range(10, 10 + KEY_TOKENS + 6))
    p = ReplayProposer([[1, 2, 3, 4, 5], long, [1, 2, 9]], 512)
    assert p.propose([1, 2, 3], 2) == [4, 5] and p.propose([1, 2], 1) == [3]
    assert p.propose(long[:KEY_TOKENS + 2], 3) == long[KEY_TOKENS + 2:KEY_TOKENS + 5]
    assert p.propose([1, 2, 9], 2) == [] and p.propose([7], 2) == []


def _ngram_scan(tokens: list[int], k: int, min_n: int, max_n: int) -> list[int]:
    """The n-gram rule written as the plain scan it is."""
    for n in range(min(max_n, len(tokens) - 1), min_n - 1, -1):
        for start in range(len(tokens) - n - 1, -1, -1):
            if tokens[start:start + n] == tokens[len(tokens) - n:]:
                return tokens[start + n:start + n + k]
    return []


def test_the_vectorised_ngram_search_is_the_plain_scan() -> None:
    rng = random.Random(0)
    for _ in range(300):
        tokens = [rng.randrange(rng.choice((2, 4, 30))) for _ in range(rng.randrange(1, 60))]
        lo = rng.randrange(1, 4)
        hi, k = rng.randrange(lo, 6), rng.randrange(1, 6)
        assert NgramProposer(lo, hi).propose(tokens, k) == _ngram_scan(tokens, k, lo, hi), (tokens, lo, hi, k)


def test_ngram_proposes_what_followed_the_latest_longest_match() -> None:
    p = NgramProposer(1, 3)
    assert p.propose([1, 2, 3, 9, 1, 2, 3, 7, 1, 2, 3], 2) == [7, 1]  # the latest occurrence of [1, 2, 3]
    assert p.propose([4, 5, 6, 4, 5, 8, 5], 3) == [8, 5]  # no 3- or 2-gram earlier: the 1-gram [5], latest
    assert p.propose([1, 2, 3], 4) == [] and p.propose([7], 2) == [] and p.propose([1, 1], 0) == []
    assert NgramProposer(2, 2).propose([4, 5, 6, 4, 5, 8, 5], 3) == []  # [8, 5] never occurred before


@pytest.mark.parametrize("bad, named", [
    ('{"method": "ngram"', "not valid JSON"),
    ({"method": "eagle", "num_speculative_tokens": 2}, "method='eagle', expected one of ['ngram', 'draft_model', 'mtp']"),
    ({"method": "ngram"}, "num_speculative_tokens is required"),
    ({"method": "mtp", "num_speculative_tokens": 2, "model": "x"}, "model='x' is the draft of method='draft_model'"),
    ({"method": "ngram", "num_speculative_tokens": True}, "num_speculative_tokens=True, expected a positive"),
    ({"method": "ngram", "num_speculative_tokens": 2, "draft": 1}, "unknown key(s) ['draft']"),
    ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 3, "prompt_lookup_max": 2},
     "prompt_lookup_min=3 exceeds prompt_lookup_max=2"),
])
def test_a_bad_speculative_config_is_refused_by_name(bad, named) -> None:
    with pytest.raises(ValueError) as err:
        EngineConfig(speculative_config=bad)
    assert named in str(err.value)
    assert SpeculativeConfig.parse('{"method": "ngram", "num_speculative_tokens": 2}').num_speculative_tokens == 2


def _arrivals() -> dict[int, list]:
    return {0: [(f"r{i}", _repetitive(9 + 5 * i, seed=i), greedy(14 + i)) for i in range(4)],
            3: [("late", _repetitive(30, seed=9), greedy(12))]}


@pytest.mark.parametrize("knobs", [{}, {"max_num_batched_tokens": 8}, {"num_kv_blocks": 14},
                                   {"enable_prefix_caching": False}],
                         ids=["plain", "chunked", "preempting", "no-prefix-caching"])
def test_greedy_tokens_equal_plain_decoding(tiny_checkpoint, knobs) -> None:
    path = tiny_checkpoint[0]
    preempting, knobs = "num_kv_blocks" in knobs, {**KNOBS, **knobs}
    plain, _ = run_engine(build_engine(path, "sync", **knobs), _arrivals())
    engine = build_engine(path, "sync", **knobs, speculative_config=NGRAM)
    assert engine.depth == 1
    spec, _ = run_engine(engine, _arrivals())
    assert spec == plain
    stats = engine.spec_stats
    assert stats.num_accepted_tokens > 0 and stats.num_draft_tokens > stats.num_accepted_tokens
    assert sum(stats.accepted_per_position) == stats.num_accepted_tokens
    assert stats.accepted_per_position == sorted(stats.accepted_per_position, reverse=True)
    if preempting:
        assert engine.scheduler.num_preemptions > 0
    assert engine.pool.num_free == engine.pool.num_blocks


def test_padded_verify_rows_equal_the_general_path(tiny_checkpoint) -> None:
    """Verify rows padded to k + 1 tokens (the path CUDA graphs capture, eager on CPU), drafts of every
    length in one batch: the same tokens and logprobs as the unpadded path, every padded token
    invisible (no KV written for it: the pool comes back whole, later steps still agree)."""
    path = tiny_checkpoint[0]
    params = greedy(16, logprobs=2)
    arrivals = {0: [(f"r{i}", _repetitive(9 + 5 * i, seed=i), params) for i in range(3)],
                4: [("late", _repetitive(30, seed=9), params)]}
    runs = {}
    for eager in (True, False):
        engine = build_engine(path, "sync", **KNOBS, speculative_config=NGRAM, enforce_eager=eager)
        finals: dict = {}
        tokens, batches = run_engine(engine, arrivals, finals=finals)
        runs[eager] = tokens, finals
        assert engine.pool.num_free == engine.pool.num_blocks
        assert (engine.runner.padded_verify_steps > 0) != eager
        assert engine.spec_stats.num_accepted_tokens > 0
    assert runs[False][0] == runs[True][0]
    for rid, want in runs[True][1].items():
        for a, b in zip(runs[False][1][rid].logprobs, want.logprobs):
            assert a.keys() == b.keys() and all(abs(a[t].logprob - b[t].logprob) < 1e-5 for t in a)


def test_logprobs_stops_and_max_tokens_inside_an_accepted_run(tiny_checkpoint) -> None:
    path = tiny_checkpoint[0]
    prompt = {"prompt_token_ids": _repetitive(16, seed=3)}
    plain_llm = LLM(path, **KNOBS)
    spec_llm = LLM(path, **KNOBS, speculative_config=NGRAM)
    want = plain_llm.generate(prompt, greedy(20, logprobs=2))[0].outputs[0]
    got = spec_llm.generate(prompt, greedy(20, logprobs=2))[0].outputs[0]
    assert got.token_ids == want.token_ids
    for a, b in zip(got.logprobs, want.logprobs):
        assert a.keys() == b.keys() and all(abs(a[t].logprob - b[t].logprob) < 1e-4 for t in a)
    stop = want.token_ids[9]  # a token deep in the output: likely inside an accepted run
    for params in (greedy(20, stop_token_ids=[stop]), greedy(7)):
        ours = spec_llm.generate(prompt, params)[0].outputs[0]
        theirs = plain_llm.generate(prompt, params)[0].outputs[0]
        assert (ours.token_ids, ours.finish_reason, ours.stop_reason) == \
               (theirs.token_ids, theirs.finish_reason, theirs.stop_reason)
    assert spec_llm.engine.spec_stats.num_accepted_tokens > 0


def _chi_square_p(a: collections.Counter, b: collections.Counter) -> float:
    """Two-sample chi-square test of equal distributions (categories pooled below 5 expected)."""
    keys = sorted(set(a) | set(b), key=lambda t: -(a[t] + b[t]))
    na, nb = sum(a.values()), sum(b.values())
    rows, rest = [], [0, 0]
    for t in keys:
        if (a[t] + b[t]) * min(na, nb) / (na + nb) >= 5:
            rows.append((a[t], b[t]))
        else:
            rest[0] += a[t]
            rest[1] += b[t]
    if sum(rest):
        rows.append(tuple(rest))
    stat = 0.0
    for x, y in rows:
        tot = x + y
        for obs, n in ((x, na), (y, nb)):
            exp = tot * n / (na + nb)
            stat += (obs - exp) ** 2 / exp
    dof = len(rows) - 1
    return float(torch.special.gammaincc(torch.tensor(dof / 2), torch.tensor(stat / 2))) if dof else 1.0


class _Fixed(PerSequence):
    """Proposes one token k times: a likely one, so that verify rows both accept and reject."""

    def __init__(self, token: int) -> None:
        self.token = token

    def propose(self, tokens, k: int) -> list[int]:
        return [self.token] * k


@pytest.mark.parametrize("sampling", [dict(temperature=0.8), dict(temperature=1.0, top_k=6),
                                      dict(temperature=1.2, top_p=0.7)], ids=["t0.8", "top-k", "top-p"])
def test_sampled_tokens_keep_the_targets_distribution(tiny_checkpoint, sampling) -> None:
    """Every decode row is a verify row proposing the token plain sampling draws most often after the
    first; the joint distribution of the 2nd to 4th tokens must be plain sampling's (a rule that
    accepted proposals more often, or resampled a rejection wrongly, would skew it)."""
    path = tiny_checkpoint[0]
    prompt = {"prompt_token_ids": _repetitive(12, seed=5)}
    n = 400
    params = [SamplingParams(max_tokens=4, ignore_eos=True, seed=1000 + i, **sampling) for i in range(n)]
    plain = LLM(path, **{**KNOBS, "max_num_seqs": 64}).generate([prompt] * n, params)
    likely = collections.Counter(o.outputs[0].token_ids[1] for o in plain).most_common(1)[0][0]
    llm = LLM(path, **{**KNOBS, "max_num_seqs": 64}, speculative_config=NGRAM)
    llm.engine.scheduler.proposer = _Fixed(likely)
    spec = llm.generate([prompt] * n, params)
    stats = llm.engine.spec_stats
    assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens
    counts = [collections.Counter(tuple(o.outputs[0].token_ids[1:]) for o in outs) for outs in (plain, spec)]
    assert _chi_square_p(*counts) > 1e-3, counts


@pytest.mark.parametrize("knobs", [{}, {"max_num_batched_tokens": 6}, {"num_kv_blocks": 16}],
                         ids=["plain", "chunked", "preempting"])
def test_async_draft_model_drafts_on_the_device_and_builds_the_sync_batches(tiny_checkpoint, make_checkpoint,
                                                                             knobs) -> None:
    """With async scheduling a draft model drafts on the device, after each step (its KV in caches indexed
    by the target's block tables; a cached prefix's blocks hold the draft's KV too): the target as its own
    draft has nearly every draft accepted, a draft of other weights few; greedy tokens equal plain
    decoding's; the mirror-off engine (depth 1, the same rules) builds the same batches and tokens."""
    path = tiny_checkpoint[0]
    preempting, knobs = "num_kv_blocks" in knobs, {**KNOBS, **knobs}
    arrivals = _arrivals()
    arrivals.setdefault(3, []).append(("cached", _repetitive(12, seed=0) + [7, 7], greedy(10)))  # a cached prefix
    plain, _ = run_engine(build_engine(path, "sync", **knobs), arrivals)
    rates = {}
    for name, draft in (("self", path), ("other", make_checkpoint(num_hidden_layers=1)[0])):
        runs = {mode: _device_draft_run(path, draft, mode, knobs, arrivals, preempting) for mode in MODES}
        assert runs["async"][0] == runs["mirror-off"][0], name
        assert runs["async"][0][0] == plain, name
        rates[name] = runs["async"][1].spec_stats.acceptance_rate
    assert rates["self"] > 0.9 > rates["other"], rates


MODES = ("mirror-off", "async")


def _device_draft_run(target: str, draft: str, mode: str, knobs: dict, arrivals: dict, preempting: bool
                      ) -> tuple[tuple[dict, list], object]:
    """``target`` drafted by ``draft`` on the device (k=3), engine ``mode``: (tokens, batches) and the engine,
    its blocks all free again and preemptions where ``preempting``."""
    engine = build_engine(target, mode, **knobs, speculative_config={
        "method": "draft_model", "model": draft, "num_speculative_tokens": 3})
    assert engine.scheduler.proposer is None and engine.runner.mtp.reads_fed
    got = run_engine(engine, arrivals)
    assert engine.runner.padded_verify_steps > 0  # verify rows on the padded path, the draft after the forward
    assert engine.pool.num_free == engine.pool.num_blocks
    assert (engine.scheduler.num_preemptions > 0) == preempting
    return got, engine


@pytest.fixture(scope="module")
def hybrid(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A Qwen3.5 checkpoint folder (Gated DeltaNet and attention layers), dummy weights."""
    import json

    from vtcore_qwen3_5.plugin import dense_example

    path = tmp_path_factory.mktemp("qwen3_5")
    (path / "config.json").write_text(json.dumps(dense_example().hf_config))
    return str(path)


@pytest.mark.parametrize("knobs", [{}, {"max_num_batched_tokens": 6}, {"num_kv_blocks": 16}],
                         ids=["plain", "chunked", "preempting"])
def test_a_hybrid_draft_model_drafts_on_the_device_from_its_state_after_the_last_accepted_token(hybrid, knobs
                                                                                               ) -> None:
    """A draft with Gated DeltaNet layers (the target itself: dummy weights of one seed) drafting on the
    device: its pass leaves its state after each verified position, its chain starts from the one after the
    last accepted token, and its cached prefixes resume from its own snapshots. A draft equal to the target
    then has nearly every draft accepted (a chain or a next step starting from another state would not);
    greedy tokens equal plain decoding's; the mirror-off engine builds the same batches and tokens."""
    preempting = "num_kv_blocks" in knobs
    knobs = {**KNOBS, "load_format": "dummy", "state_snapshot_interval": 8, **knobs}
    arrivals = _arrivals()
    arrivals.setdefault(3, []).append(("cached", _repetitive(12, seed=0) + [7, 7], greedy(10)))
    # a prompt ending at a snapshot (taken after the forward: the draft's after its pass), then its hit
    ends = _repetitive(16, seed=11)
    arrivals[0].append(("snapshot-end", ends, greedy(2)))
    arrivals.setdefault(6, []).append(("hit-at-it", ends + [3, 1, 4], greedy(16)))
    # alone, once the others are done: one lone chunk (the padded path) with a snapshot at its end
    arrivals[80] = [("alone", _repetitive(8, seed=13), greedy(4))]
    plain, _ = run_engine(build_engine(hybrid, "sync", **knobs), arrivals)
    runs = {}
    for mode in MODES:
        runs[mode], engine = _device_draft_run(hybrid, hybrid, mode, knobs, arrivals, preempting)
        stats, runner, drafter = engine.spec_stats, engine.runner, engine.runner.mtp
        assert stats.num_accepted_tokens > 0.9 * stats.num_draft_tokens, (mode, stats)
        # the same weights over the same rows: the draft's state equals the target's in every slot but its
        # chain's (live, snapshot and draft-state slots); snapshots were taken at a fed run's end
        assert runner.num_state_snapshots and drafter.chain_state_base < len(drafter.stateful[0].states["conv"])
        assert runner.padded_chunk_steps > 0 or "max_num_batched_tokens" in knobs, runner.padded_chunk_steps
        for target, draft in zip(runner.target_stateful, drafter.stateful, strict=True):
            for name, t in target.states.items():
                assert torch.equal(t, draft.states[name][:drafter.chain_state_base]), (mode, name)
    assert runs["async"] == runs["mirror-off"]
    assert runs["async"][0] == plain


def test_a_draft_model_that_cannot_draft_on_the_device_is_refused_by_name(tiny_checkpoint, make_checkpoint,
                                                                          hybrid, monkeypatch) -> None:
    from vtcore.layers.gated_deltanet import GatedDeltaNet

    monkeypatch.setattr(GatedDeltaNet, "supports_decode_graphs", False)
    config = {"method": "draft_model", "model": hybrid, "num_speculative_tokens": 2}
    with pytest.raises(VtcoreError, match=r"the draft model .* \(family 'qwen3_5'\) has stateful layers "
                                          r"\(GatedDeltaNet\) that cannot decode from device slots .*: use "
                                          "async_scheduling=False"):
        build_engine(tiny_checkpoint[0], "async", **KNOBS, load_format="dummy", speculative_config=config)
    with pytest.raises(VtcoreError, match="vocab_size=256.*must share the target's vocabulary"):
        build_engine(tiny_checkpoint[0], "async", **KNOBS, speculative_config={
            **config, "model": make_checkpoint(vocab_size=256)[0]})


def test_the_device_ngram_search_proposes_what_the_host_proposer_does() -> None:
    """The device n-gram's search over padded rows of several sequences at once: its first tokens are the
    host proposer's proposal; past it (or with none) the sequence's last token repeated."""
    from vtcore.worker.ngram import DeviceNgram

    rng = random.Random(1)
    for _ in range(40):
        lo = rng.randrange(1, 4)
        hi, k = rng.randrange(lo, 6), rng.randrange(1, 6)
        seqs = [[rng.randrange(rng.choice((2, 4, 30))) for _ in range(rng.randrange(1, 40))] for _ in range(5)]
        rows = torch.tensor([s + [rng.randrange(30) for _ in range(45 - len(s))] for s in seqs])  # garbage past
        got = DeviceNgram(lo, hi, k, 4, 44, torch.device("cpu")).search(rows, torch.tensor([len(s) for s in seqs]))
        for seq, draft in zip(seqs, got.tolist()):
            want = NgramProposer(lo, hi).propose(seq, k)
            assert draft == want + [seq[-1]] * (k - len(want)), (seq, lo, hi, k)


@pytest.mark.parametrize("knobs", [{}, {"max_num_batched_tokens": 6}, {"num_kv_blocks": 16}],
                         ids=["plain", "chunked", "preempting"])
def test_async_ngram_drafts_on_the_device_and_builds_the_sync_batches(tiny_checkpoint, knobs) -> None:
    """With async scheduling the n-gram searches each request's tokens on the device (its history written
    from the fed ids, a cached prefix and the accepted tokens) and the next step floats over the accepted
    count: the mirror-off engine (depth 1, the same rules) builds the same batches and tokens, greedy tokens
    equal plain decoding's, and drafts are accepted."""
    path = tiny_checkpoint[0]
    preempting, knobs = "num_kv_blocks" in knobs, {**KNOBS, **knobs}
    arrivals = _arrivals()
    arrivals.setdefault(3, []).append(("cached", _repetitive(12, seed=0) + [7, 7], greedy(10)))  # a cached prefix
    plain, _ = run_engine(build_engine(path, "sync", **knobs), arrivals)
    runs = {}
    for mode in ("mirror-off", "async"):
        engine = build_engine(path, mode, **knobs, speculative_config=NGRAM)
        assert engine.depth == (2 if mode == "async" else 1) and engine.runner.ngram is not None
        if mode == "mirror-off":  # after each step the device's history holds every token the host has
            step, checked = engine.step, collections.Counter()

            def step_and_check(step=step, engine=engine, checked=checked) -> list:
                outs = step()
                history = engine.runner.ngram.history
                for r in engine.scheduler.running:  # (mid-prefill: the chunks fed so far)
                    n = r.num_tokens if r.num_output_tokens else r.num_computed_tokens
                    assert history[r.mirror_slot, :n].tolist() == r.token_ids[:n], r.request_id
                    checked[r.request_id] += 1
                return outs

            engine.step = step_and_check
        floating: list[int] = []
        runs[mode] = run_engine(engine, arrivals, observe=lambda b: floating.extend(s.floats for s in b if s.floats))
        stats = engine.spec_stats
        assert floating and stats.num_accepted_tokens > 0
        assert engine.pool.num_free == engine.pool.num_blocks
        if preempting:
            assert engine.scheduler.num_preemptions > 0
    assert runs["async"] == runs["mirror-off"]
    assert runs["async"][0] == plain
    assert checked["cached"] and checked["late"]


@pytest.mark.parametrize("knobs", [{}, {"num_kv_blocks": 16}, {"state_snapshot_interval": 4}],
                         ids=["plain", "preempting", "snapshots"])
def test_a_hybrid_family_resumes_its_state_from_the_last_accepted_token(tmp_path, knobs) -> None:
    """Qwen3.5's Gated DeltaNet state after a verify row must be the state after its last accepted
    token: replayed proposals with one token changed in a cycle accept every run length; greedy
    tokens must equal plain decoding's (they differ when the state is not rolled back), on the general
    path (eager) and on the padded verify rows CUDA graphs capture (the state after each token written to
    its slot by the layer's device-indexed path)."""
    import json

    from vtcore.spec.replay import ReplayProposer
    from vtcore_qwen3_5.plugin import dense_example

    (tmp_path / "config.json").write_text(json.dumps(dense_example().hf_config))
    preempting, knobs = "num_kv_blocks" in knobs, {**KNOBS, "load_format": "dummy", **knobs}
    arrivals = {0: [(f"r{i}", _repetitive(7 + 6 * i, seed=20 + i), greedy(15)) for i in range(3)],
                2: [("late", _repetitive(9, seed=30), greedy(12))]}
    plain, _ = run_engine(build_engine(str(tmp_path), "sync", **knobs), arrivals)
    prompts = {rid: ids for batch in arrivals.values() for rid, ids, _ in batch}
    for eager in (True, False):
        engine = build_engine(str(tmp_path), "sync", **knobs, speculative_config=NGRAM, enforce_eager=eager)
        engine.scheduler.proposer = ReplayProposer([prompts[r] + plain[r] for r in plain], 512, reject_every=True)
        spec, _ = run_engine(engine, arrivals)
        assert spec == plain
        assert (engine.runner.padded_verify_steps > 0) != eager
        per_pos = engine.spec_stats.accepted_per_position
        assert 0 < per_pos[-1] < per_pos[0] < engine.spec_stats.num_drafts  # full, partial and no acceptance
        if preempting:
            assert engine.scheduler.num_preemptions > 0


def test_counters_reach_request_outputs_and_prometheus(tiny_checkpoint) -> None:
    from vtcore.server.metrics import ServerMetrics

    llm = LLM(tiny_checkpoint[0], **KNOBS, speculative_config=NGRAM)
    prompts = [{"prompt_token_ids": _repetitive(14 + i, seed=i)} for i in range(3)]
    outs = llm.generate(prompts, greedy(16))
    stats = llm.engine.stats()
    assert sum(o.metrics.num_draft_tokens for o in outs) == stats.spec_decode_num_draft_tokens > 0
    assert sum(o.metrics.num_accepted_tokens for o in outs) == stats.spec_decode_num_accepted_tokens > 0
    assert len(stats.spec_decode_accepted_per_position) == NGRAM["num_speculative_tokens"]
    text = ServerMetrics("m", llm.engine.stats).render()
    assert f'vtcore:spec_decode_num_accepted_tokens_total{{model_name="m"}} ' \
           f'{stats.spec_decode_num_accepted_tokens}' in text
    for pos, n in enumerate(stats.spec_decode_accepted_per_position):
        assert f'vtcore:spec_decode_num_accepted_tokens_per_pos{{model_name="m",position="{pos}"}} {n}' in text
    plain = LLM(tiny_checkpoint[0], **KNOBS).generate(prompts[0], greedy(4))[0]
    assert (plain.metrics.num_draft_tokens, plain.metrics.num_accepted_tokens) == (0, 0)


def test_a_draft_model_proposes_for_every_row_in_one_batch(tiny_checkpoint, make_checkpoint) -> None:
    """The target as its own draft accepts (nearly) everything; a one-layer draft of other weights
    accepts little; both give plain decoding's greedy tokens, with one draft call a step."""
    path = tiny_checkpoint[0]
    plain, _ = run_engine(build_engine(path, "sync", **KNOBS), _arrivals())
    other = make_checkpoint(num_hidden_layers=1)[0]
    rates = {}
    for name, draft in (("self", path), ("other", other)):
        engine = build_engine(path, "sync", **KNOBS, speculative_config={
            "method": "draft_model", "model": draft, "num_speculative_tokens": 3})
        spec, batches = run_engine(engine, _arrivals())
        assert spec == plain, name
        proposer = engine.scheduler.proposer
        assert 0 < proposer.calls <= len(batches)  # one batched call a step at most
        assert not proposer.engine.has_unfinished_requests()
        rates[name] = engine.spec_stats.acceptance_rate
    assert rates["self"] > 0.9 > rates["other"]


@pytest.mark.parametrize("bad, named", [
    ({"method": "draft_model", "num_speculative_tokens": 2}, "method='draft_model' needs model"),
    ({"method": "ngram", "num_speculative_tokens": 2, "model": "x"}, "method='ngram' takes none"),
])
def test_a_draft_model_config_names_what_is_wrong(bad, named) -> None:
    with pytest.raises(ValueError, match=named):
        EngineConfig(speculative_config=bad)


def test_a_draft_of_another_vocabulary_is_refused(tiny_checkpoint, make_checkpoint) -> None:
    draft = make_checkpoint(vocab_size=256)[0]
    with pytest.raises(VtcoreError, match="vocab_size=256.*must share the target's vocabulary"):
        build_engine(tiny_checkpoint[0], "sync", **KNOBS, speculative_config={
            "method": "draft_model", "model": draft, "num_speculative_tokens": 2})


@pytest.mark.parametrize("num_kv_blocks", [30, 400], ids=["evicting", "roomy"])
def test_async_device_drafts_cache_and_free_what_sync_does(tiny_checkpoint, num_kv_blocks) -> None:
    """Requests ending inside accepted runs, then next turns over their answers (prefix-cache hits), with
    drafts replayed so verify rows accept every count: the async engine registers, frees and evicts cached
    blocks as the mirror-off engine does (an ended request's blocks wait for its verify rows to settle,
    freed in arrival order in both), so the batches stay equal; tokens equal plain decoding's."""
    from vtcore.testing.replay_drafts import replay_device_drafts

    path = tiny_checkpoint[0]
    knobs = {**KNOBS, "num_kv_blocks": num_kv_blocks, "max_num_batched_tokens": 256}
    for seed in range(3):
        rng = random.Random(seed)
        arrivals: dict[int, list] = {}
        for i in range(6):
            arrivals.setdefault(rng.choice([0, 0, 1, 3]), []).append(
                (f"r{i}", _repetitive(rng.randrange(5, 20), seed * 10 + i), greedy(rng.randrange(5, 30))))
        plain, _ = run_engine(build_engine(path, "sync", **knobs), arrivals)
        prompts = {rid: ids for batch in arrivals.values() for rid, ids, _ in batch}
        for i, rid in enumerate(sorted(plain)):  # a chat's next turn: prompt, answer and more
            arrivals.setdefault(25 + i, []).append((f"t{rid}", prompts[rid] + plain[rid] + [1, 2], greedy(4)))
        runs = {}
        for mode in ("mirror-off", "async"):
            engine = build_engine(path, mode, **knobs, speculative_config=NGRAM)
            replay_device_drafts(engine, [prompts[r] + plain[r] for r in plain])
            runs[mode] = run_engine(engine, arrivals)
            assert engine.pool.num_free == engine.pool.num_blocks and not engine.scheduler.ending
            assert engine.pool.hits > 0
        assert runs["async"] == runs["mirror-off"], seed
        assert {r: runs["async"][0][r] for r in plain} == plain


def test_a_request_the_pool_just_holds_finishes_with_device_drafts(tiny_checkpoint) -> None:
    """Blocks grow past what a step computes only for an MTP head's chain, and never past the request's own
    end: a request whose prompt and max_tokens fill the pool exactly finishes (it preempted itself forever)."""
    engine = build_engine(tiny_checkpoint[0], "async", device="cpu", block_size=4, num_kv_blocks=10, max_num_seqs=4,
                          speculative_config=NGRAM)
    engine.add_request("a", {"prompt_token_ids": list(range(1, 21))}, greedy(20))
    for _ in range(100):
        if any(o.finished for o in engine.step()):
            break
    else:
        pytest.fail(f"not finished after 100 steps ({engine.scheduler.num_preemptions} preemptions)")
