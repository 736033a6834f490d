"""One set of engine arguments, vLLM's names, for ``LLM``, ``AsyncLLM`` and every command that builds an engine.

:class:`vtcore.config.EngineConfig` is the one definition: ``add_engine_args`` makes one
``--kebab-name`` flag of each field from its type and metadata (``vtcore generate``, ``bench`` and
``serve`` all call it), ``engine_config_from_args`` builds the config of the flags given, and
``engine_config`` is how ``LLM`` and ``AsyncLLM`` build theirs. Torch-free: the parsers import it.
"""
from __future__ import annotations

import argparse
import json
import sys
import typing
from typing import Any, Callable, Mapping, Sequence

import attrs

from vtcore.config import DEFAULT_MODEL, EngineConfig, fraction, positive

#: the namespace attribute of ``vtcore serve``'s deprecated ``--model`` (MODEL is positional there)
MODEL_OPTION = "model_option"


def flag(name: str) -> str:
    """The flag of an EngineConfig field: ``max_num_seqs`` -> ``--max-num-seqs``."""
    return "--" + name.replace("_", "-")


def _checked(flag_name: str, convert: Callable[[str], Any], accept: Callable[[Any], bool],
             expected: str) -> Callable[[str], Any]:
    """An argparse type: ``convert(text)`` where ``accept`` takes it, else an error naming the flag and text."""
    def parse(text: str) -> Any:
        try:
            value = convert(text)
        except ValueError:
            value = None
        if value is None or not accept(value):
            raise argparse.ArgumentTypeError(f"{flag_name}={text!r}: expected {expected}")
        return value
    return parse


def positive_int(flag_name: str) -> Callable[[str], int]:
    """An argparse type: a positive integer; anything else is refused naming ``flag_name`` and the text."""
    return _checked(flag_name, int, lambda v: v > 0, "a positive integer")


def non_negative_int(flag_name: str) -> Callable[[str], int]:
    """An argparse type: an integer >= 0; anything else is refused naming ``flag_name`` and the text."""
    return _checked(flag_name, int, lambda v: v >= 0, "an integer >= 0")


def unit_fraction(flag_name: str) -> Callable[[str], float]:
    """An argparse type: a number in (0, 1]; anything else is refused naming ``flag_name`` and the text."""
    return _checked(flag_name, float, lambda v: 0.0 < v <= 1.0, "a fraction in (0, 1]")


def _flag_fields() -> list[attrs.Attribute]:
    """EngineConfig's fields that have a flag, their annotations resolved to types."""
    return [f for f in attrs.fields(attrs.resolve_types(EngineConfig)) if f.metadata.get("flag", True)]


def _value_kwargs(field: attrs.Attribute) -> dict[str, Any]:
    """How argparse reads the field's value: a boolean pair of flags, a checked number, a choice, text."""
    if field.type in (bool, bool | None):
        return {"action": argparse.BooleanOptionalAction}
    if field.validator is positive:
        return {"type": positive_int(flag(field.name)), "metavar": "N"}
    if field.validator is fraction:
        return {"type": unit_fraction(flag(field.name)), "metavar": "FRACTION"}
    if "choices" in field.metadata:
        return {"choices": field.metadata["choices"]}
    if "metavar" in field.metadata:  # text the field's converter parses (JSON)
        return {"type": str, "metavar": field.metadata["metavar"]}
    kinds = [t for t in typing.get_args(field.type) if t is not type(None)] or [field.type]
    return {"type": kinds[0]}


def _help(field: attrs.Attribute, shown_defaults: Mapping[str, str]) -> str:
    default = shown_defaults.get(field.name, field.metadata.get("default_help", field.default))
    return f"{field.metadata['help']} (default: {default})".replace("%", "%%")


class DeprecatedFlag(argparse.Action):
    """A deprecated flag, still taken: ``warning`` goes to stderr (``{prog}``: the command's name) and the flag
    stores its value, or ``const`` for a flag of no value (``nargs=0``)."""

    def __init__(self, *args: Any, warning: str, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.warning = warning

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: Any,
                 option_string: str | None = None) -> None:
        sys.stderr.write(f"{parser.prog}: warning: {self.warning.format(prog=parser.prog)}\n")
        setattr(namespace, self.dest, self.const if self.nargs == 0 else values)


def add_engine_args(parser: argparse.ArgumentParser, *, positional_model: bool = False,
                    shown_defaults: Mapping[str, str] | None = None) -> None:
    """Add one flag per EngineConfig field (``--max-num-seqs``, ``--enforce-eager/--no-enforce-eager``,
    ...) to ``parser``, in a group of their own.

    Only the flags typed land in the namespace (their default is ``argparse.SUPPRESS``); help shows
    EngineConfig's default, or ``shown_defaults[name]`` where the command sets its own. With
    ``positional_model`` the model is ``MODEL``, positional and optional, as ``vllm serve`` takes it, and
    ``--model`` still works, deprecated (a warning when given).
    """
    group = parser.add_argument_group("engine arguments (vLLM's names; vtcore.config.EngineConfig)")
    shown = shown_defaults or {}
    for field in _flag_fields():
        if field.name == "model" and positional_model:
            group.add_argument("model", nargs="?", default=argparse.SUPPRESS, metavar="MODEL",
                               help=_help(field, shown))
            group.add_argument("--model", dest=MODEL_OPTION, default=argparse.SUPPRESS, metavar="MODEL",
                               action=DeprecatedFlag, help="deprecated: pass MODEL positionally",
                               warning="--model is deprecated; pass the model positionally: {prog} MODEL")
            continue
        names = [flag(field.name)] + ([field.metadata["short"]] if "short" in field.metadata else [])  # vLLM's
        group.add_argument(*names, dest=field.name, default=argparse.SUPPRESS, help=_help(field, shown),
                           **_value_kwargs(field))


def _model_given(args: argparse.Namespace) -> dict[str, str]:
    """``{"model": ...}`` of MODEL or the deprecated ``--model``, or {} when neither was given; both,
    disagreeing, is an error naming both."""
    positional, option = getattr(args, "model", None), getattr(args, MODEL_OPTION, None)
    if positional is not None and option is not None and positional != option:
        raise ValueError(f"MODEL={positional!r} and --model={option!r} disagree: pass the model once, as MODEL")
    model = positional if positional is not None else option
    return {} if model is None else {"model": model}


def _flags_named(message: str, names: Sequence[str]) -> str:
    """A validator's ``name=value: ...`` message with the name spelled as its flag, for names given as flags."""
    for name in names:
        if message.startswith(f"{name}="):
            return flag(name) + message[len(name):]
    return message


def engine_config_from_args(args: argparse.Namespace, **command_defaults: Any) -> EngineConfig:
    """The EngineConfig of the engine flags in ``args`` (from ``add_engine_args``), over the command's own
    defaults, over EngineConfig's; a value a validator refuses raises a ValueError naming its flag."""
    given = {f.name: getattr(args, f.name) for f in _flag_fields() if f.name != "model" and hasattr(args, f.name)}
    given.update(_model_given(args))
    try:
        return EngineConfig(**{**command_defaults, **given})
    except ValueError as exc:
        raise ValueError(_flags_named(str(exc), list(given))) from None


def engine_argv(config: EngineConfig) -> list[str]:
    """``config`` as a command line of engine flags (MODEL positional, as ``vtcore serve`` takes it; only the
    fields that differ from EngineConfig's defaults): another vtcore command builds the same config from it."""
    argv: list[str] = [config.model]
    for field in _flag_fields():
        value = getattr(config, field.name)
        if field.name == "model" or value == field.default:
            continue
        if isinstance(value, bool):
            argv.append(flag(field.name) if value else "--no-" + flag(field.name)[2:])
        elif isinstance(value, dict):  # a JSON flag's value
            argv += [flag(field.name), json.dumps(value)]
        elif attrs.has(type(value)):  # a JSON flag's parsed value
            argv += [flag(field.name), json.dumps(attrs.asdict(value))]
        else:
            argv += [flag(field.name), str(value)]
    return argv


def engine_config(front_end: str, model: str | None, kwargs: Mapping[str, Any]) -> EngineConfig:
    """The EngineConfig of ``LLM(model, **kwargs)`` or ``AsyncLLM(model, **kwargs)`` (``front_end`` names
    which): no model is the embedded default; an unknown keyword raises a TypeError naming it."""
    try:
        return EngineConfig(model=model or DEFAULT_MODEL, **kwargs)
    except TypeError as exc:
        raise TypeError(f"{front_end}(): {exc}; knobs are those of vtcore.config.EngineConfig") from None
