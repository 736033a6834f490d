"""Exceptions raised by vtcore. Each names the bad value and what was expected."""
from __future__ import annotations

import traceback
from typing import Callable


class VtcoreError(Exception):
    """Base class of every error vtcore raises on purpose."""


class PluginError(VtcoreError):
    """A plugin failed to load, registered something invalid, or clashes with another plugin."""


class UnknownArchitectureError(VtcoreError, ValueError):
    """No registered model family serves the checkpoint's architecture."""


class CheckpointError(VtcoreError, ValueError):
    """A checkpoint file or tensor is missing, unexpected, misshapen, corrupt or of an unsupported dtype."""


class ConfigError(VtcoreError, ValueError):
    """A checkpoint's config.json holds a field of the wrong type or value, or lacks one the model needs."""


class NoMTPHead(ConfigError):
    """A model was asked for its multi-token-prediction head, and its family (or checkpoint) has none."""


class MissingConfigField(ConfigError, AttributeError):
    """config.json lacks a field the model reads (an AttributeError too, so ``getattr(..., default)`` works)."""


class ModelNotFoundError(VtcoreError, FileNotFoundError):
    """A model argument is no folder, and the Hugging Face hub id it would be cannot be had (not in the
    cache offline, the hub unreachable, no such repository, a gated one)."""


class RequestRejected(VtcoreError, ValueError):
    """A request can never be served (too long for the context or for the KV pool, bad token ids)."""


class DeviceTokenOverrideIgnored(VtcoreError, RuntimeError):
    """A forward embedded stale host token ids although the step's real ids live on the device.

    Raised by the shared EmbedInto when the runner marked the step's host ids as stale (async
    placeholders) and no device-token override is in scope: the model family bypassed the override.
    """

    def __init__(self, family: str) -> None:
        super().__init__(
            f"model family {family!r}: EmbedInto ignores the device-token override "
            "(the step's host token ids are placeholders and no override was in scope); "
            "embed through vtcore.layers.embedding.EmbedInto"
        )
        self.family = family


class NotSupportedError(VtcoreError, NotImplementedError):
    """A feature the user asked for that vtcore does not implement."""


class ProfilerStateError(VtcoreError, RuntimeError):
    """``start_profile`` while a profile records, ``stop_profile`` while none does, or either with no profiler
    configured."""


class EngineDeadError(VtcoreError, RuntimeError):
    """The engine loop of an ``AsyncLLM`` died; every pending and later request raises this."""


def raised_at(exc: BaseException, ours: Callable[[str], bool], innermost_if_none: bool = False) -> str:
    """" (raised at FILE:LINE in FUNCTION)" for the innermost frame of ``exc``'s traceback whose file ``ours``
    accepts (the line a failure report should point at), else for its innermost frame when
    ``innermost_if_none``, else ""."""
    frames = traceback.extract_tb(exc.__traceback__)
    kept = [f for f in frames if ours(f.filename)] or (frames if innermost_if_none else [])
    return f" (raised at {kept[-1].filename}:{kept[-1].lineno} in {kept[-1].name})" if kept else ""
