"""Quantization: the ``QuantMethod`` interface (``vtcore.quant.base``), the FP4 formats' shared
method and reference decode, and ``vtcore quantize``. Nothing here is imported by ``import vtcore``."""
