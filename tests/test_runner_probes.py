"""The runner probes bite where they should and nowhere else (CPU): staging poisoned when the guard
allows changes nothing; poisoned right after the upload (on CPU the device views are the host
buffer) it must change the step; the withheld override must raise."""
from __future__ import annotations

import pytest

from vtcore.conformance.harness import build_engine, greedy, run_engine
from vtcore.errors import DeviceTokenOverrideIgnored
from vtcore.testing.runner_probes import poison_staging, withhold_override

KNOBS = {"device": "cpu", "dtype": "float32", "block_size": 8, "num_kv_blocks": 64, "max_model_len": 64,
         "max_num_seqs": 4}
ARRIVALS = {0: [("a", [3, 1, 4, 1, 5], greedy(8)), ("b", [9, 2, 6], greedy(8))]}


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_poison_at_the_guard_changes_nothing_and_early_poison_bites(tiny_checkpoint, mode: str) -> None:
    ref, _ = run_engine(build_engine(tiny_checkpoint[0], mode, **KNOBS), ARRIVALS)
    guarded = build_engine(tiny_checkpoint[0], mode, **KNOBS)
    poison_staging(guarded.runner, "guard")
    assert run_engine(guarded, ARRIVALS)[0] == ref
    early = build_engine(tiny_checkpoint[0], mode, **KNOBS)
    poison_staging(early.runner, "early")
    try:
        got, _ = run_engine(early, ARRIVALS)
    except Exception:  # noqa: BLE001 - placeholder ids or slots: raising is biting too
        got = None
    assert got != ref


def test_withheld_override_raises_and_unknown_poison_is_named(tiny_checkpoint) -> None:
    eng = build_engine(tiny_checkpoint[0], "async", **KNOBS)
    withhold_override(eng.runner)
    assert eng.runner.decode_graphs is None
    with pytest.raises(DeviceTokenOverrideIgnored):
        run_engine(eng, ARRIVALS)
    with pytest.raises(ValueError, match="when='late': expected one of"):
        poison_staging(eng.runner, "late")
