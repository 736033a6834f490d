"""The conformance gate on this plugin's family, through vtcore's pytest plugin, on one rank and on two."""
from vtcore.conformance.suite import ConformanceSuite


class TestQwen3DenseConformance(ConformanceSuite):
    family = "qwen3_dense"


class TestQwen3DenseConformanceTensorParallel2(TestQwen3DenseConformance):
    """The same checks on engines of two ranks (a worker process over gloo)."""

    tensor_parallel_size = 2
