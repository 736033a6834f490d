"""The conformance gate on the Llama family, through vtcore's pytest plugin."""
from vtcore.conformance.suite import ConformanceSuite


class TestLlamaConformance(ConformanceSuite):
    family = "llama"
