"""Exceptions raised by vtcore. Each names the bad value and what was expected."""
from __future__ import annotations


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
