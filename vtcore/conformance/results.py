"""A check's result and the two ways a check ends early."""
from __future__ import annotations

import attrs


@attrs.define
class CheckResult:
    check: str
    status: str  # "pass", "fail" or "skip"
    detail: str = ""


class Failed(Exception):
    """A check failed; the message says what to fix."""


class Skipped(Exception):
    """A check could not run; the message says why."""
