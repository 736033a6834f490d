"""A check's result, the two ways a check ends early, and the hook a gate reports each result to as it ends."""
from __future__ import annotations

import time
from typing import Any, Callable

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


def timed(run: Callable[..., CheckResult], *args: Any) -> CheckResult:
    """``run(*args)``'s result with the seconds it took."""
    start = time.perf_counter()
    result = run(*args)
    result.seconds = time.perf_counter() - start
    return result


class Failed(Exception):
    """A check failed; the message says what to fix."""


class Skipped(Exception):
    """A check could not run; the message says why."""
