"""Structured outputs: grammar-constrained decoding (xgrammar), vLLM's ``StructuredOutputsParams``."""
from vtcore.structured.params import StructuredOutputsParams

__all__ = ["StructuredOutputsParams"]
