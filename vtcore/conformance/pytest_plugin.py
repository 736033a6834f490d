"""The conformance gate as a pytest plugin (entry point ``pytest11: vtcore``), for plugins' own test suites.

In a plugin's tests, subclass the suite and name the family; each gate check becomes a test::

    from vtcore.conformance.suite import ConformanceSuite

    class TestMyFamilyConformance(ConformanceSuite):
        family = "my_family"

Run with ``--vtcore-device cuda`` to check on a GPU. This module imports nothing heavy: pytest
loads it in every session of every project that has vtcore installed.
"""
from __future__ import annotations

import pytest


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("vtcore", "vtcore conformance gate")
    group.addoption("--vtcore-device", default="cpu", choices=("cpu", "cuda"),
                    help="device the conformance suite runs vtcore's engine on (default: cpu)")
