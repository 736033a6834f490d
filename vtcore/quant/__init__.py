"""Quantization: the ``QuantMethod`` take-over interface (``vtcore.quant.base``) and the FP4 formats'
shared method (the weight operand and its reference decode are ``vtcore.kernels.fp4``'s); the offline
converter is ``vtcore.tools.quantize``. Nothing here is imported by ``import vtcore``."""
