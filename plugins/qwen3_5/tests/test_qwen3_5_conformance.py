"""The conformance gate on the Qwen3.5 dense and MoE families, through vtcore's pytest plugin."""
from vtcore.conformance.suite import ConformanceSuite


class TestQwen3_5Conformance(ConformanceSuite):
    family = "qwen3_5"


class TestQwen3_5MoeConformance(ConformanceSuite):
    family = "qwen3_5_moe"
