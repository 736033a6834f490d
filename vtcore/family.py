"""What a model-family plugin registers: `ModelFamily` and its `ConformanceExample`."""
from __future__ import annotations

import importlib
import re
from typing import Any

import attrs

from vtcore.errors import PluginError

_REF = re.compile(r"^[A-Za-z_][\w.]*:[A-Za-z_]\w*$")


def resolve_ref(ref: str) -> Any:
    """Import a lazy ``"module:attribute"`` reference."""
    module, _, attr = ref.partition(":")
    return getattr(importlib.import_module(module), attr)


def _check_ref(instance: Any, attribute: attrs.Attribute, value: Any) -> None:
    if not (isinstance(value, str) and _REF.match(value)):
        raise ValueError(f"{attribute.name}={value!r}: expected a lazy reference 'package.module:Name'")


def _check_optional_ref(instance: Any, attribute: attrs.Attribute, value: Any) -> None:
    if value is not None:
        _check_ref(instance, attribute, value)


def _architectures(value: Any) -> tuple[str, ...]:
    if isinstance(value, str) or not isinstance(value, (list, tuple)) or not value \
            or not all(isinstance(a, str) and a for a in value):
        raise ValueError(f"architectures={value!r}: expected a non-empty tuple of HF architecture names")
    return tuple(value)


def _patterns(value: Any) -> tuple[str, ...]:
    if isinstance(value, str) or not isinstance(value, (list, tuple)) or not all(isinstance(p, str) and p for p in value):
        raise ValueError(f"quant_ignore={value!r}: expected a tuple of module names or 're:' regexes")
    for pattern in value:
        if pattern.startswith("re:"):
            try:
                re.compile(pattern[3:])
            except re.error as exc:
                raise ValueError(f"quant_ignore pattern {pattern!r}: not a valid regular expression ({exc})") from None
    return tuple(value)


@attrs.frozen
class ConformanceExample:
    """A tiny model the conformance gate runs a family on, and the HF class that is its oracle.

    ``hf_config`` is a config.json dict (``architectures`` included) small enough for CPU float32;
    ``oracle`` is a lazy reference to the transformers class that defines the correct math.
    """

    hf_config: dict[str, Any]
    oracle: str = attrs.field(validator=_check_ref)


@attrs.frozen
class ModelFamily:
    """A model family: the HF architectures it serves and the class that implements them.

    ``model_cls`` is imported only when a model of the family is built, so registering a family
    costs no import of torch code. ``consumes_device_tokens`` declares that the family's forward
    embeds through the shared EmbedInto and so honours the async device-token override.
    ``quant_ignore``: the checkpoint modules an offline quantizer must leave dense (routers, gates,
    a vision tower), as module names or ``re:`` regexes over the HF model's module names
    (compressed-tensors' ``ignore`` syntax); ``vtcore quantize`` adds those that match to its ignore list.
    ``plugin`` is filled in by the plugin manager with the entry-point name that registered it.
    """

    name: str
    architectures: tuple[str, ...] = attrs.field(converter=_architectures)
    model_cls: str = attrs.field(validator=_check_ref)
    consumes_device_tokens: bool = False
    conformance_example: str | None = attrs.field(default=None, validator=_check_optional_ref)
    quant_ignore: tuple[str, ...] = attrs.field(default=(), converter=_patterns)
    plugin: str = ""

    def load_class(self) -> type:
        """Import and return the model class (an error names the family and its plugin)."""
        try:
            return resolve_ref(self.model_cls)
        except (ImportError, AttributeError) as exc:
            raise PluginError(f"model family {self.name!r} (plugin {self.plugin!r}): model_cls {self.model_cls!r} "
                              f"cannot be imported: {type(exc).__name__}: {exc}") from exc
