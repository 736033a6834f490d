"""A check's result, the two ways a check ends early, and the hook a gate reports each result to as it ends."""
from __future__ import annotations

import time
from typing import Callable, Iterable

import attrs


@attrs.define
class CheckResult:
    check: str
    status: str  # "pass", "fail" or "skip"
    detail: str = ""
    #: how long the check ran, its engines' start and shutdown included (and the oracle checkpoint's building, for
    #: the first check that needs it)
    seconds: float = 0.0


#: called with a gate's name (a family's, a quant format's) and each check's result as soon as it ends: a long gate
#: (every family on a GPU runs for minutes) shows where it is, and a run cut short still says what passed
Progress = Callable[[str, CheckResult], None]


def run_in_order(name: str, checks: Iterable[str], run: Callable[[str], CheckResult],
                 results: dict[str, CheckResult], progress: Progress | None) -> dict[str, CheckResult]:
    """``run(check)`` for each check in order into ``results``, each result with the seconds it took and handed
    to ``progress`` (with the gate's ``name``) as it ends."""
    for check in checks:
        start = time.perf_counter()
        result = results[check] = run(check)
        result.seconds = time.perf_counter() - start
        if progress is not None:
            progress(name, result)
    return results


class Failed(Exception):
    """A check failed; the message says what to fix."""


class Skipped(Exception):
    """A check could not run; the message says why."""
