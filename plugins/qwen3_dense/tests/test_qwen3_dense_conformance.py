"""The conformance gate on this plugin's family, through vtcore's pytest plugin."""
from vtcore.conformance.suite import ConformanceSuite


class TestQwen3DenseConformance(ConformanceSuite):
    family = "qwen3_dense"
