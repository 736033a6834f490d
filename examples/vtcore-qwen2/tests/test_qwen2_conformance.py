"""The conformance gate on the Qwen2 family, through vtcore's pytest plugin, on one rank and on two."""
import pytest

from vtcore.conformance.suite import ConformanceSuite


class TestQwen2Conformance(ConformanceSuite):
    family = "qwen2"


@pytest.mark.timeout(300)  # the gate runs in the first test's setup: two ranks take about a minute
class TestQwen2ConformanceTensorParallel2(TestQwen2Conformance):
    """The same checks on engines of two ranks (a worker process over gloo)."""

    tensor_parallel_size = 2
