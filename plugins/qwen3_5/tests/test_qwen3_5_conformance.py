"""The conformance gate on the Qwen3.5 dense and MoE families, through vtcore's pytest plugin, on one rank
and on two."""
import pytest

from vtcore.conformance.suite import ConformanceSuite


class TestQwen3_5Conformance(ConformanceSuite):
    family = "qwen3_5"


class TestQwen3_5MoeConformance(ConformanceSuite):
    family = "qwen3_5_moe"


@pytest.mark.timeout(300)  # the gate runs in the first test's setup: two ranks take about a minute
class TestQwen3_5ConformanceTensorParallel2(TestQwen3_5Conformance):
    """The same checks on engines of two ranks (a worker process over gloo)."""

    tensor_parallel_size = 2


@pytest.mark.timeout(300)  # the gate runs in the first test's setup: two ranks take about a minute
class TestQwen3_5MoeConformanceTensorParallel2(TestQwen3_5MoeConformance):
    """The same checks on engines of two ranks (a worker process over gloo)."""

    tensor_parallel_size = 2
