"""The gate's checks of issue 19 bite: non-trivial oracle tensors, the tensor-sensitivity check and the
hostile schedule, each shown by a fixture family that only it catches, and by disabling it."""
from __future__ import annotations

import io
import time

import pytest

from vtcore.cli.main import main
from vtcore.conformance import CHECKS, checks, schedule
from vtcore.conformance.checks import PREREQUISITES
from vtcore.conformance.gate import run_gate, write_table
from vtcore.plugins.manager import Plugins, reset_plugins

INPUT_NORM = "likely cause: the oracle agrees with the family once model.layers.*.input_layernorm.weight (2 tensors) " \
             "is set to 1 (the family ignores it, or loads it wrongly)"
CACHED_CONTEXT = "a prefill chunk must attend over the"  # the schedule's and the prefix check's hint
BIASES = ".bias ("  # every Linear.bias (6 tensors) or, over the structured check's few tokens, v_proj.bias alone

#: fixture family -> (the checks it fails, a phrase each failure message holds, how to disable what catches it)
FIXTURES = {
    "ignores_norm_weight": ({"oracle-greedy", "oracle-logprobs", "oracle-schedule", "prefix-cache", "speculative",
                             "structured"}, INPUT_NORM,
                            "redraw"),
    "dropped_bias": ({"oracle-greedy", "oracle-logprobs", "oracle-schedule", "prefix-cache", "speculative",
                      "structured"}, BIASES, "redraw"),
    "prefill_ignores_cache": ({"oracle-schedule", "prefix-cache", "speculative"}, CACHED_CONTEXT,
                              ("oracle-schedule", "prefix-cache", "speculative")),
    "cached_prefix_off_by_one": ({"oracle-schedule", "prefix-cache", "speculative"}, CACHED_CONTEXT,
                                 ("oracle-schedule", "prefix-cache", "speculative")),
    "host_context_length": ({"speculative"}, "shifted on the device", ("speculative",)),
    "state_not_reset": ({"oracle-schedule"}, "were given a state slot another request had used", ("oracle-schedule",)),
    "snapshot_into_read_slot": ({"prefix-cache", "speculative"}, "state_out_slots", ("prefix-cache", "speculative")),
    "padding_into_state": ({"prefix-cache", "speculative"}, "state_tokens", ("prefix-cache", "speculative")),
    "verify_state_only_at_end": ({"speculative"}, "state_out_index", ("speculative",)),
    "dead_tensor": ({"parameters"}, "leaves 1 oracle tensor(s) untestable: resetting 'model.unused.weight'",
                    ("parameters",)),
}


def _disable(how: str | tuple[str, ...], monkeypatch: pytest.MonkeyPatch) -> None:
    if how == "redraw":
        monkeypatch.setattr("vtcore.testing.oracle.redraw_constants", lambda model, seed: {})
        return
    for check in how:
        monkeypatch.setattr(checks.FamilyGate, f"check_{check.replace('-', '_')}", lambda self: "disabled")


@pytest.mark.parametrize("family", FIXTURES)
def test_each_fixture_fails_exactly_its_checks_naming_the_cause(plugins: Plugins, family: str) -> None:
    expected, phrase, _ = FIXTURES[family]
    (gate,) = run_gate([family], plugins=plugins, quant=[])
    failed = {c for c, r in gate.results.items() if r.status == "fail"}
    assert failed == expected, {c: gate.results[c].detail for c in failed}
    for check in expected:
        assert phrase in gate.results[check].detail, gate.results[check].detail
    out = io.StringIO()
    write_table([gate], out, "cpu")
    assert "Traceback" not in out.getvalue() and f"FAIL {sorted(expected)[0]}: family {family!r}" in out.getvalue()


@pytest.mark.parametrize("family", FIXTURES)
def test_disabling_the_check_lets_its_fixture_pass(plugins: Plugins, family: str,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    expected, _, how = FIXTURES[family]
    _disable(how, monkeypatch)
    (gate,) = run_gate([family], plugins=plugins, quant=[], checks=sorted(expected))  # the others passed above
    ran = {c: r for c, r in gate.results.items() if c in expected or c in PREREQUISITES}
    assert {r.status for r in ran.values()} == {"pass"}, {c: r.detail for c, r in ran.items()}


def test_cli_names_the_failed_check_and_family(plugins: Plugins) -> None:
    reset_plugins(plugins)
    out = io.StringIO()
    assert main(["conformance", "--family", "prefill_ignores_cache", "--family", "qwen3_dense", "--no-quant",
                 "--check", "oracle-schedule"], out=out) == 1
    text = out.getvalue()
    assert "FAIL oracle-schedule: family 'prefill_ignores_cache'" in text and "Traceback" not in text
    assert text.rstrip().endswith("FAILED: 1 family (prefill_ignores_cache) of 2; quant methods: none run")


def test_an_unknown_check_is_named_before_any_check_runs(plugins: Plugins, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(checks.FamilyGate, "run", lambda self, *args: pytest.fail("a check ran"))
    with pytest.raises(ValueError, match=r"checks=\['oracle-schedul'\]: not gate checks; expected some of example"):
        run_gate(["qwen3_dense"], plugins=plugins, quant=[], checks=["oracle-schedul"])


def test_each_check_is_reported_as_it_ends_with_its_seconds(plugins: Plugins, monkeypatch: pytest.MonkeyPatch) -> None:
    """A long gate (minutes on a GPU) says where it is, and a run cut short what had passed: each result reaches
    ``progress`` before the next check starts, with the seconds its check took."""
    reported: list[tuple[str, str]] = []
    structure = checks.FamilyGate.check_structure

    def slow_structure(self: checks.FamilyGate) -> str:
        assert reported == [("qwen3_dense", "example")], reported  # (a failed assert fails the check)
        time.sleep(0.3)
        return structure(self)

    monkeypatch.setattr(checks.FamilyGate, "check_structure", slow_structure)
    (gate,) = run_gate(["qwen3_dense"], plugins=plugins, quant=[], checks=["structure"],
                       progress=lambda name, result: reported.append((name, result.check)))
    assert reported == [("qwen3_dense", c) for c in CHECKS]
    assert gate.results["structure"].status == "pass", gate.results["structure"].detail
    assert gate.results["structure"].seconds >= 0.3 > gate.results["example"].seconds


def test_a_crashing_check_names_the_line_it_raised_at(plugins: Plugins, monkeypatch: pytest.MonkeyPatch) -> None:
    """A check that raises fails its family and says where (outside torch), not only what."""
    import torch

    def crash(self: checks.FamilyGate) -> str:
        return str(torch.ones(2) + torch.ones(3))

    monkeypatch.setattr(checks.FamilyGate, "check_example", crash)
    (gate,) = run_gate(["qwen3_dense"], plugins=plugins, quant=[], checks=["example"])
    detail = gate.results["example"].detail
    assert gate.results["example"].status == "fail" and "example raised RuntimeError" in detail, detail
    assert f"(raised at {__file__}:" in detail and "in crash)" in detail, detail


def test_the_hostile_schedule_proves_what_it_built(plugins: Plugins, monkeypatch: pytest.MonkeyPatch) -> None:
    """A pool with room for everything never preempts: the check says so rather than passing."""
    monkeypatch.setattr(schedule, "KNOBS", {**schedule.KNOBS, "num_kv_blocks": 64})
    (gate,) = run_gate(["qwen3_dense"], plugins=plugins, quant=[], checks=["oracle-schedule"])
    detail = gate.results["oracle-schedule"].detail
    assert gate.results["oracle-schedule"].status == "fail" and "ran without preemption" in detail, detail


def test_the_prefix_check_holds_the_cache_to_the_hashes(plugins: Plugins, monkeypatch: pytest.MonkeyPatch) -> None:
    """A scheduler that stopped reusing cached blocks fails the check (naming vtcore), not passes it."""
    from vtcore.engine.scheduler import Scheduler

    monkeypatch.setattr(Scheduler, "_reuse_prefix", lambda self, req: None)
    (gate,) = run_gate(["qwen3_dense"], plugins=plugins, quant=[], checks=["prefix-cache"])
    result = gate.results["prefix-cache"]
    assert result.status == "fail" and "'whole-prompt': (0, 24)" in result.detail and "vtcore bug" in result.detail


def test_the_prefix_check_requires_lone_chunks_on_the_padded_path(plugins: Plugins,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """Cache hits leave a chunk alone in its step, which the padded chunk path serves; a runner that stopped
    sending them there fails the check (naming vtcore) instead of passing unchecked."""
    from vtcore.worker.decode_graphs import DecodeGraphs

    takes = DecodeGraphs.takes
    monkeypatch.setattr(DecodeGraphs, "takes", lambda self, batch: not self.chunk and takes(self, batch))
    (gate,) = run_gate(["qwen3_dense"], plugins=plugins, quant=[], checks=["prefix-cache"])
    result = gate.results["prefix-cache"]
    assert result.status == "fail" and "took the padded chunk path" in result.detail, result.detail


def test_the_draft_model_pass_requires_its_own_example_to_be_accepted(plugins: Plugins,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """A draft engine that proposes one token late (it was fed all but the last token) keeps the output
    exact, since rejections leave no trace; only the acceptance rule of the draft-model pass catches it."""
    from vtcore.spec.draft_model import DraftModelProposer

    late = DraftModelProposer.propose_batch
    monkeypatch.setattr(DraftModelProposer, "propose_batch",
                        lambda self, requests: late(self, [(tokens[:-1], k) for tokens, k in requests]))
    (gate,) = run_gate(["qwen3_dense"], plugins=plugins, quant=[], checks=["speculative"])
    result = gate.results["speculative"]
    assert result.status == "fail" and "the family's own example as its draft had" in result.detail, result.detail


def test_oracle_checkpoints_hold_no_constant_tensor(make_checkpoint) -> None:
    _, hf = make_checkpoint()
    for name, p in hf.named_parameters():
        assert p.unique().numel() > 1, name
    init = hf.vtcore_init_constants
    assert init["model.norm.weight"] == 1.0 and init["model.layers.0.self_attn.q_norm.weight"] == 1.0
    assert not any(n.endswith("proj.weight") for n in init)  # random draws are kept, not recorded


def test_a_swapped_weight_mapping_is_named_as_the_likely_cause(plugins: Plugins) -> None:
    """A family that loads gate_proj and up_proj each into the other's shard (same shapes: ``weights``, which
    places tensors by the family's own mapping, cannot see it) fails the oracle, which agrees once its two tensors
    are swapped in every layer: the hint names the pair (no reset of one tensor explains it)."""
    (gate,) = run_gate(["swapped_gate_up"], plugins=plugins, quant=[])
    detail = gate.results["oracle-greedy"].detail
    assert gate.results["oracle-greedy"].status == "fail", detail
    assert detail.endswith("; likely cause: the oracle agrees with the family once model.layers.*.mlp.gate_proj.weight "
                           "and model.layers.*.mlp.up_proj.weight (2 pairs) are swapped (the family loads each into "
                           "the other's place: check its packed_modules_mapping or checkpoint_name)"), detail


def test_a_fault_everywhere_is_pinned_on_no_tensor_and_no_feature(plugins: Plugins) -> None:
    """A RoPE with the wrong theta makes every request a little wrong: no check's hint may blame a tensor (a reset
    that matched one request by chance once did) or what the schedule did to some requests."""
    (gate,) = run_gate(["wrong_rope_theta"], plugins=plugins, quant=[])
    failed = {c: r.detail for c, r in gate.results.items() if r.status == "fail"}
    assert {"oracle-greedy", "oracle-schedule", "prefix-cache", "structured"} <= set(failed), failed
    assert not any("likely cause" in detail for detail in failed.values()), failed
    assert "all 9 requests differ, whatever the schedule did to each" in failed["oracle-schedule"]
    out = io.StringIO()
    write_table([gate], out, "cpu")
    assert "note wrong_rope_theta: oracle-greedy fails on the plainest requests: fix it first" in out.getvalue()


def test_the_fix_greedy_first_note_needs_a_later_check_failing(plugins: Plugins) -> None:
    """A failing oracle-greedy is named as the root to fix only over checks after it: an earlier failure (the
    weights) is the likelier root."""
    from vtcore.conformance.checks import CheckResult

    (gate,) = run_gate(["qwen3_dense"], plugins=plugins, quant=[], checks=["example"])
    note = "note qwen3_dense: oracle-greedy fails on the plainest requests: fix it first"
    for failing, shown in ((("weights", "oracle-greedy"), False), (("oracle-greedy", "async-abc"), True),
                           (("oracle-greedy",), False)):
        for check in failing:
            gate.results[check] = CheckResult(check, "fail", "why")
        out = io.StringIO()
        write_table([gate], out, "cpu")
        assert (note in out.getvalue()) == shown, (failing, out.getvalue())
        for check in failing:
            gate.results[check] = CheckResult(check, "pass")


def test_cuda_checks_skip_on_cpu_saying_why(plugins: Plugins) -> None:
    (gate,) = run_gate(["qwen3_dense"], plugins=plugins, quant=[], checks=["cuda-graphs", "cuda-bf16"])
    assert {(r.status, r.detail) for c, r in gate.results.items() if c.startswith("cuda")} == \
        {("skip", "runs with --device cuda")}
    assert gate.results["oracle-greedy"].detail == "not selected (--check)"
    assert set(CHECKS) >= {"parameters", "oracle-schedule", "cuda-graphs", "cuda-bf16"}


def test_the_mtp_pass_catches_a_head_fed_the_wrong_next_tokens(plugins: Plugins,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """Drafts that leave no trace keep the output exact; only the MTP pass's from-scratch comparison sees a
    runner that feeds the head a wrong token where the host knew the next one (here: every prompt token)."""
    from vtcore.worker import model_runner
    from vtcore.worker.drafting import NO_TOKEN

    rows = model_runner.draft_rows

    def wrong(batch, block_size, *layout):
        got = rows(batch, block_size, *layout)
        got.next_ids = [t if t == NO_TOKEN else 0 for t in got.next_ids]
        return got

    monkeypatch.setattr(model_runner, "draft_rows", wrong)
    (gate,) = run_gate(["qwen3_5"], plugins=plugins, quant=[], checks=["speculative"])
    result = gate.results["speculative"]
    assert result.status == "fail" and "the head run from scratch" in result.detail, result.detail


@pytest.mark.parametrize(("family", "broken"), [("qwen3_5", "unshifted"), ("qwen3_5", "state_not_resumed"),
                                               ("qwen3_dense", "unshifted")])
def test_the_device_draft_passes_catch_a_floating_share_run_wrongly(plugins: Plugins, monkeypatch: pytest.MonkeyPatch,
                                                                    family: str, broken: str) -> None:
    """A share scheduled right after its request's verify row floats: its positions, KV slots and context
    length shift by the accepted count on the device, and the stateful layers resume from the state after
    the last accepted token. Running it at the host's unshifted positions, or on the state after the whole
    draft, must fail the device passes (their replayed drafts accept every count): the MTP pass (qwen3_5),
    and the n-gram's, whose verify steps take the padded path (qwen3_dense)."""
    from vtcore.worker.model_runner import ModelRunner

    if broken == "unshifted":
        shifted = ModelRunner._float
        monkeypatch.setattr(ModelRunner, "_float", lambda self, floats, pos, slots, ctx, table: shifted(
            self, floats, pos.clone(), slots.clone(), ctx.clone(), table))
    else:
        monkeypatch.setattr(ModelRunner, "_resume_floating", lambda self, floats, shift: None)
    (gate,) = run_gate([family], plugins=plugins, quant=[], checks=["speculative"])
    result = gate.results["speculative"]
    # (a state left after the whole draft may show first in the drafts of a random head's rare accepted run)
    assert result.status == "fail" and ("shifted on the device" in result.detail
                                        or "the head run from scratch" in result.detail), result.detail
