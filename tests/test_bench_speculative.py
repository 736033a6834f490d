"""``vtcore bench --speculative-config``: the replay bound, the configured method and the plain step,
self-consistent (no performance thresholds)."""
from __future__ import annotations

import math
import re

import pytest

from tests.test_bench import COPY_MIB, _run
from vtcore.bench.speculative import timed_run

SPEC = '{"method": "ngram", "num_speculative_tokens": 2}'
OUTPUT_LEN = 10


@pytest.fixture(scope="module")
def spec_doc(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict, str]:
    return _run(tmp_path_factory.mktemp("spec"), ["--speculative-config", SPEC, "--speculative-k", "1,3",
                                                  "--concurrency", "1,3", "--input-len", "12", "--output-len",
                                                  str(OUTPUT_LEN), "--copy-mib", COPY_MIB])


def test_replay_accepts_everything_and_equals_plain(spec_doc) -> None:
    doc, table = spec_doc
    assert doc["mode"] == "speculative" and doc["ks"] == [1, 3] and doc["method"] == "ngram"
    assert doc["method_async_depth"] == 1 and "(replay runs: 1, ngram: 1)" in table  # the host n-gram: sync
    assert [r["concurrency"] for r in doc["runs"]] == [1, 3]
    for r in doc["runs"]:
        assert r["plain_decode_steps"] == OUTPUT_LEN - 1  # one token a step after the prefill's
        assert r["plain_step_ms"] > 0 and math.isclose(
            r["roofline"]["tpot_over_roofline"] * r["roofline"]["roofline_ms"], r["plain_tpot_ms"], rel_tol=1e-6)
        for e in r["replay"]:
            k = e["k"]
            # forced to the recorded tokens; on CPU in float32 the target samples them itself
            assert e["acceptance_rate"] == 1.0 and e["target_agreement"] == 1.0
            # every step after the prefill verifies k proposals; the last one's draft is cut to the tokens
            # max_tokens leaves, and with one left that step is a plain decode step
            full, rest = divmod(OUTPUT_LEN - 1, k + 1)
            assert e["verify_steps"] == full + (rest > 1)
            assert e["padded_verify_steps"] == e["verify_steps"]  # every verify batch fits the padded path
            assert e["accepted_per_position"][0] == e["verify_steps"] * r["concurrency"]  # a draft a row
            assert e["speedup"] == pytest.approx(r["plain_tpot_ms"] / e["tpot_ms"])
        assert r["method"]["k"] == 2 and r["method"]["outputs_equal"]
    assert "replay k=3" in table and "ngram k=2" in table and "NOT equal" not in table
    assert "{" not in table and re.search(r"replay k=3: verify step [\d.]+ ms \([\d.]+x plain; \d+ of \d+ padded\), "
                                          r"TPOT [\d.]+ ms", table)
    assert "target's own tokens as recorded 100.0%" in table


def test_teacher_forcing_accepts_a_recording_the_target_disagrees_with(tiny_checkpoint) -> None:
    """A recording the target would never sample (every token shifted by one) is still what the forced
    run emits, all of it accepted, and the agreement counts how little the target sampled it."""
    from vtcore.bench.speculative import TeacherForcing
    from vtcore.conformance.harness import build_engine
    from vtcore.spec.replay import ReplayProposer

    knobs = dict(device="cpu", block_size=4, num_kv_blocks=64, max_num_seqs=4)
    prompts = [[5, 9, 2, 7, 1, 3, 8, 6, 4], [11, 12, 13, 14, 15, 16, 17, 18, 19, 20]]
    plain = build_engine(tiny_checkpoint[0], "sync", **knobs)
    recorded = [p + [(t + 1) % 512 for t in run] for p, run in zip(prompts, timed_run(plain, prompts, 9, "p").tokens)]
    engine = build_engine(tiny_checkpoint[0], "sync", **knobs,
                          speculative_config={"method": "ngram", "num_speculative_tokens": 3})
    engine.scheduler.proposer = ReplayProposer(recorded, 512)
    forcing = TeacherForcing({tuple(p): r for p, r in zip(prompts, recorded)})
    forcing.install(engine)
    got = timed_run(engine, prompts, 9, "f")
    assert [p + t for p, t in zip(prompts, got.tokens)] == recorded
    assert engine.spec_stats.acceptance_rate == 1.0 and forcing.sampled == 2 * 9
    assert forcing.agreement is not None and forcing.agreement < 0.5


@pytest.mark.parametrize("shift", [0, 1], ids=["own", "disagreeing"])
def test_the_device_replay_forces_and_drafts_the_recording_at_async_depth(tiny_checkpoint, shift: int) -> None:
    """On the device path (the n-gram's async engine: floating shares, padded verify steps) the replay forces
    every sampled token to the recording and drafts what follows: the run emits the recording, every draft is
    accepted, and the agreement says how much of it the target sampled itself (all of its own greedy run in
    float32; little of a recording shifted by one)."""
    from vtcore.bench.device_replay import DeviceReplay
    from vtcore.conformance.harness import build_engine

    knobs = dict(device="cpu", block_size=4, num_kv_blocks=64, max_num_seqs=4)
    prompts = [[5, 9, 2, 7, 1, 3, 8, 6, 4], [11, 12, 13, 14, 15, 16, 17, 18, 19, 20]]
    plain = build_engine(tiny_checkpoint[0], "sync", **knobs)
    recorded = [p + [(t + shift) % 512 for t in run]
                for p, run in zip(prompts, timed_run(plain, prompts, 13, "p").tokens)]
    engine = build_engine(tiny_checkpoint[0], "async", **knobs,
                          speculative_config={"method": "ngram", "num_speculative_tokens": 3})
    replay = DeviceReplay({tuple(p): r for p, r in zip(prompts, recorded)}, engine)
    got = timed_run(engine, prompts, 13, "f")
    assert engine.depth == 2 and [p + t for p, t in zip(prompts, got.tokens)] == recorded
    stats = engine.spec_stats
    assert stats.acceptance_rate == 1.0 and stats.num_drafts >= 2 * 3 and engine.runner.padded_verify_steps > 0
    assert (replay.agreement == 1.0) if not shift else (replay.agreement is not None and replay.agreement < 0.5)


def test_the_bench_refuses_what_it_cannot_measure(tmp_path) -> None:
    from tests.test_bench import _parser

    args = _parser().parse_args(["bench", "--device", "cpu", "--speculative-config", SPEC,
                                 "--compare-prefix-caching"])
    with pytest.raises(ValueError, match="--compare-prefix-caching compares serving sweeps"):
        args.func(args, None)
