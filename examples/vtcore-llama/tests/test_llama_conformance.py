"""The conformance gate on the Llama family, through vtcore's pytest plugin, on one rank and on two."""
from vtcore.conformance.suite import ConformanceSuite


class TestLlamaConformance(ConformanceSuite):
    family = "llama"


class TestLlamaConformanceTensorParallel2(TestLlamaConformance):
    """The same checks on engines of two ranks (a worker process over gloo)."""

    tensor_parallel_size = 2
