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


@pytest.fixture(scope="class")
def conformance_results(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> dict:
    """The family gate's results for a ``ConformanceSuite`` subclass (its ``family``), run once per class."""
    from vtcore.conformance.checks import FamilyGate
    from vtcore.plugins.manager import get_plugins, use_plugins

    cls = request.cls
    if not getattr(cls, "family", ""):
        pytest.fail(f"{cls.__name__}.family is not set: name the model family to check")
    plugins = get_plugins()
    gate = FamilyGate(plugins, plugins.family(cls.family), request.config.getoption("vtcore_device"),
                      str(tmp_path_factory.mktemp("conformance")), getattr(cls, "tensor_parallel_size", 1))
    with use_plugins(plugins):
        return gate.run()


@pytest.fixture(scope="class")
def quant_results(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> dict:
    """The quant gate's results for a ``QuantConformanceSuite`` subclass (its ``format``) over every
    registered family with a conformance example, run once per class."""
    from vtcore.conformance.quant_checks import QuantGate
    from vtcore.plugins.manager import get_plugins, use_plugins

    cls = request.cls
    if not getattr(cls, "format", ""):
        pytest.fail(f"{cls.__name__}.format is not set: name the quant format to check")
    plugins = get_plugins()
    plugins.quant_method(cls.format)
    gate = QuantGate(plugins, cls.format, [plugins.families[n] for n in sorted(plugins.families)],
                     request.config.getoption("vtcore_device"), str(tmp_path_factory.mktemp("quant-conformance")))
    with use_plugins(plugins):
        return gate.run()
