"""The conformance gate on the Qwen2 family, through vtcore's pytest plugin."""
from vtcore.conformance.suite import ConformanceSuite


class TestQwen2Conformance(ConformanceSuite):
    family = "qwen2"
