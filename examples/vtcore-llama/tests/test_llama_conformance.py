"""The conformance gate on the Llama family, through vtcore's pytest plugin, on one rank and on two."""
import pytest

from vtcore.conformance.suite import ConformanceSuite


class TestLlamaConformance(ConformanceSuite):
    family = "llama"


@pytest.mark.timeout(300)  # the gate runs in the first test's setup: two ranks take about a minute
class TestLlamaConformanceTensorParallel2(TestLlamaConformance):
    """The same checks on engines of two ranks (a worker process over gloo)."""

    tensor_parallel_size = 2
