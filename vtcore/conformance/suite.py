"""``ConformanceSuite``: the base class a plugin's tests subclass to run the gate on its family."""
from __future__ import annotations

from typing import Any

import pytest

from vtcore.conformance import CHECKS, QUANT_CHECKS


class ConformanceSuite:
    """Set ``family`` to a registered family name; every gate check becomes one test.

    The gate runs once per class (its checkpoint and engines are shared by the checks); a failed
    check fails its test with the gate's message saying what to fix, and a skipped one skips.
    """

    family: str = ""

    @pytest.fixture(scope="class")
    def conformance_results(self, request: pytest.FixtureRequest,
                            tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
        from vtcore.conformance.checks import FamilyGate
        from vtcore.plugins.manager import get_plugins, use_plugins

        if not self.family:
            pytest.fail(f"{type(self).__name__}.family is not set: name the model family to check")
        plugins = get_plugins()
        device = request.config.getoption("vtcore_device", default="cpu")
        gate = FamilyGate(plugins, plugins.family(self.family), device, str(tmp_path_factory.mktemp("conformance")))
        with use_plugins(plugins):
            return gate.run()

    @pytest.mark.parametrize("check", CHECKS)
    def test_conformance(self, conformance_results: dict[str, Any], check: str) -> None:
        result = conformance_results[check]
        if result.status == "skip":
            pytest.skip(result.detail)
        if result.status == "fail":
            pytest.fail(result.detail, pytrace=False)


class QuantConformanceSuite:
    """Set ``format`` to a registered compressed-tensors format; each quant check becomes one test,
    run over every registered family with a conformance example."""

    format: str = ""

    @pytest.fixture(scope="class")
    def quant_results(self, request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
        from vtcore.conformance.quant_checks import QuantGate
        from vtcore.plugins.manager import get_plugins, use_plugins

        if not self.format:
            pytest.fail(f"{type(self).__name__}.format is not set: name the quant format to check")
        plugins = get_plugins()
        plugins.quant_method(self.format)
        device = request.config.getoption("vtcore_device", default="cpu")
        gate = QuantGate(plugins, self.format, [plugins.families[n] for n in sorted(plugins.families)], device,
                         str(tmp_path_factory.mktemp("quant-conformance")))
        with use_plugins(plugins):
            return gate.run()

    @pytest.mark.parametrize("check", QUANT_CHECKS)
    def test_quant_conformance(self, quant_results: dict[str, Any], check: str) -> None:
        result = quant_results[check]
        if result.status == "skip":
            pytest.skip(result.detail)
        if result.status == "fail":
            pytest.fail(result.detail, pytrace=False)
