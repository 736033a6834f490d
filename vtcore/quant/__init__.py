"""The quantization interface that quant-method plugins implement."""
from vtcore.quant.base import QuantMethod

__all__ = ["QuantMethod"]
