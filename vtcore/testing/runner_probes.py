"""Probes installed on one built runner for tests: the conformance gate's B arm (the override
withheld) and the GPU race probes (staging poisoned, sampling delayed).

Each wraps a seam of :class:`vtcore.worker.model_runner.ModelRunner` on that instance (``scope``,
``decode_graphs``, ``staging``, ``sample``), never the class, so the production object carries no
test switch.
"""
from __future__ import annotations

from typing import Any

import torch

from vtcore.worker.decode_graphs import PLACEHOLDER

POISON = ("early", "guard")


def withhold_override(runner: Any) -> None:
    """Every forward runs with no device-token override in scope (its host ids still marked stale),
    and eagerly: a captured graph holds the scope it was captured with."""
    scope = runner.scope
    runner.scope = lambda ids, stale: scope(None, stale)
    runner.decode_graphs = None


def poison_staging(runner: Any, when: str) -> None:
    """Fill a step's staging buffer with the placeholder ``when``: ``"early"`` right after its upload
    is enqueued (the control arm: reuse without the guard), ``"guard"`` at the first moment the guard
    allows (when its step retires)."""
    staging = runner.staging
    if when == "early":
        upload = staging.upload

        def poisoned_upload(staged: Any, dest: torch.Tensor | None = None, into: int | None = None
                            ) -> list[torch.Tensor]:
            views = upload(staged, dest, into)
            staged.host.fill_(PLACEHOLDER)
            return views

        staging.upload = poisoned_upload
    elif when == "guard":
        retire = staging.retire

        def poisoned_retire(index: int) -> None:
            retire(index)
            staging.buffer(index).fill_(PLACEHOLDER)

        staging.retire = poisoned_retire
    else:
        raise ValueError(f"when={when!r}: expected one of {POISON}")


def delay_sampling(runner: Any, cycles: int) -> None:
    """A GPU spin of ``cycles`` before every sampling (widens the window a staging race needs)."""
    sample = runner.sample

    def delayed(*args: Any, **kwargs: Any) -> None:
        torch.cuda._sleep(cycles)
        sample(*args, **kwargs)

    runner.sample = delayed
