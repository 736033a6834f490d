"""The conformance gate's quant section on this plugin's format, through vtcore's pytest plugin."""
from vtcore.conformance.suite import QuantConformanceSuite


class TestNVFP4Conformance(QuantConformanceSuite):
    format = "nvfp4-pack-quantized"
