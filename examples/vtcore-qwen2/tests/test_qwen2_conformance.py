"""The conformance gate on the Qwen2 family, through vtcore's pytest plugin, on one rank and on two."""
from vtcore.conformance.suite import ConformanceSuite


class TestQwen2Conformance(ConformanceSuite):
    family = "qwen2"


class TestQwen2ConformanceTensorParallel2(TestQwen2Conformance):
    """The same checks on engines of two ranks (a worker process over gloo)."""

    tensor_parallel_size = 2
