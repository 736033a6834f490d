"""Quantization: the ``QuantMethod`` interface (``vtcore.quant.base``), the FP4 formats' shared
method (the weight operand and its reference decode are ``vtcore.kernels.fp4``'s), and ``vtcore
quantize``. Nothing here is imported by ``import vtcore``."""
