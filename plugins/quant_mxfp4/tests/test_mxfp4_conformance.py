"""The conformance gate's quant section on this plugin's format, through vtcore's pytest plugin."""
from vtcore.conformance.suite import QuantConformanceSuite


class TestMXFP4Conformance(QuantConformanceSuite):
    format = "mxfp4-pack-quantized"
