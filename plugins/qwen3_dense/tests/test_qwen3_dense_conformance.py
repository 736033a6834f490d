"""The conformance gate on this plugin's family, through vtcore's pytest plugin, on one rank and on two."""
import pytest

from vtcore.conformance.suite import ConformanceSuite


class TestQwen3DenseConformance(ConformanceSuite):
    family = "qwen3_dense"


@pytest.mark.timeout(300)  # the gate runs in the first test's setup: two ranks take about a minute
class TestQwen3DenseConformanceTensorParallel2(TestQwen3DenseConformance):
    """The same checks on engines of two ranks (a worker process over gloo)."""

    tensor_parallel_size = 2
