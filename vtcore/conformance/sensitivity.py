"""Which oracle tensors the gate can see, and which one a family's disagreement points at.

Both reset oracle tensors to their init value (0 for tensors transformers draws at random) with
:mod:`vtcore.testing.parameters`; the oracle's own logits say what changed.
"""
from __future__ import annotations

from typing import Callable

import torch
from torch import nn

from vtcore.testing.oracle import teacher_forced_logits
from vtcore.testing.parameters import init_value, reset, reset_groups, swap_groups, swapped

#: Resetting one tensor must move some log-probability of the probe by at least this much: 100
#: times the gate's near-tie and logprob tolerance, so a family that drops it cannot pass by a tie.
MIN_EFFECT = 1e-2


def _init(model: nn.Module) -> dict[str, float]:
    return getattr(model, "vtcore_init_constants", {})


def tensor_effects(model: nn.Module, probe: list[int]) -> dict[str, float]:
    """Parameter name -> the largest change of any log-probability along ``probe`` (teacher-forced)
    when that parameter alone is reset."""
    base = torch.log_softmax(teacher_forced_logits(model, probe).double(), -1)
    effects = {}
    for name, _ in model.named_parameters():
        with reset(model, [name], _init(model)):
            moved = torch.log_softmax(teacher_forced_logits(model, probe).double(), -1) - base
        effects[name] = float(moved.abs().max())
    return effects


def likely_cause(model: nn.Module, agrees: Callable[[nn.Module], bool]) -> str:
    """The first reset (one tensor, one tensor across layers, one kind of tensor), else the first swap of two
    same-shaped tensors of one module in every layer, under which ``agrees(model)`` holds, as a sentence for a
    failure message; "" when none does."""
    init = _init(model)
    for what, names in reset_groups(model):
        with reset(model, names, init):
            if agrees(model):
                values = sorted({init_value(n, init) for n in names})
                value = f"{values[0]:g}" if len(values) == 1 else "its init values"
                return (f"; likely cause: the oracle agrees with the family once {what} is set to {value} "
                        "(the family ignores it, or loads it wrongly)")
    for what, pairs in swap_groups(model):
        with swapped(model, pairs):
            if agrees(model):
                return (f"; likely cause: the oracle agrees with the family once {what} are swapped (the family "
                        "loads each into the other's place: check its packed_modules_mapping or checkpoint_name)")
    return ""
