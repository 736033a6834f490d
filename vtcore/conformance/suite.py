"""``ConformanceSuite``: the base class a plugin's tests subclass to run the gate on its family.

The gate's results are class-scoped fixtures of vtcore's pytest plugin
(:mod:`vtcore.conformance.pytest_plugin`), read off ``request.cls``: a fixture defined as a method
of these classes would be a class-scoped instance-method fixture, which pytest 9 deprecates.
"""
from __future__ import annotations

from typing import Any

import pytest

from vtcore.conformance import CHECKS, QUANT_CHECKS


def _report(result: Any) -> None:
    if result.status == "skip":
        pytest.skip(result.detail)
    if result.status == "fail":
        pytest.fail(result.detail, pytrace=False)


class ConformanceSuite:
    """Set ``family`` to a registered family name; every gate check becomes one test.

    The gate runs once per class (its checkpoint and engines are shared by the checks); a failed
    check fails its test with the gate's message saying what to fix, and a skipped one skips. A
    subclass with ``tensor_parallel_size = 2`` runs the checks on engines of two ranks (worker
    processes over gloo on the CPU), as ``vtcore conformance --tensor-parallel-size 2`` does.
    """

    family: str = ""
    tensor_parallel_size: int = 1

    @pytest.mark.parametrize("check", CHECKS)
    def test_conformance(self, conformance_results: dict[str, Any], check: str) -> None:
        _report(conformance_results[check])


class QuantConformanceSuite:
    """Set ``format`` to a registered compressed-tensors format; each quant check becomes one test,
    run over every registered family with a conformance example."""

    format: str = ""

    @pytest.mark.parametrize("check", QUANT_CHECKS)
    def test_quant_conformance(self, quant_results: dict[str, Any], check: str) -> None:
        _report(quant_results[check])
