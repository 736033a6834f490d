"""vtcore: an LLM inference engine extended by plugins.

``import vtcore`` stays light: the engine (torch, transformers) loads on first use of ``LLM``.
"""
from __future__ import annotations

from typing import Any

from vtcore.inputs import TextPrompt, TokensPrompt
from vtcore.outputs import CompletionOutput, Logprob, RequestOutput
from vtcore.plugins.hookspecs import hookimpl
from vtcore.sampling_params import RequestOutputKind, SamplingParams

__version__ = "0.1.0"
__all__ = ["LLM", "AsyncLLM", "SamplingParams", "RequestOutput", "CompletionOutput", "Logprob", "RequestOutputKind",
           "TextPrompt", "TokensPrompt", "hookimpl", "__version__"]

_LAZY = {"LLM": "vtcore.engine.llm", "LLMEngine": "vtcore.engine.llm_engine", "AsyncLLM": "vtcore.engine.async_llm"}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'vtcore' has no attribute {name!r}")
