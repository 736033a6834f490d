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


def _none_or_empty(value: Any) -> bool:
    return value is None or value == {}


#: vLLM engine arguments this engine has no use for, each with what it takes (the values that ask for nothing, a
#: ported script's defaults) and how a refusal says so: a ported ``LLM(...)`` call runs unchanged where it asks
#: for nothing, and is refused naming the argument where it asks for what this engine does not do
VLLM_IDLE_ARGS: dict[str, tuple[Callable[[Any], bool], str]] = {
    "quantization": (lambda v: v is None, "None: the checkpoint's own quantization_config is read"),
    "kv_cache_dtype": (lambda v: v == "auto", "'auto': the KV cache is in the model's dtype"),
    "tokenizer_mode": (lambda v: v == "auto", "'auto'"),
    "revision": (lambda v: v is None, "None"),
    "tokenizer_revision": (lambda v: v is None, "None"),
    "download_dir": (lambda v: v is None, "None"),
    "enable_lora": (lambda v: not v, "False: LoRA adapters are not supported"),
    "enable_chunked_prefill": (lambda v: v in (None, True), "True: prompts are always prefilled in chunks"),
    "disable_log_stats": (lambda v: isinstance(v, bool), "a bool (logging only)"),
    "disable_custom_all_reduce": (lambda v: isinstance(v, bool), "a bool"),
    "swap_space": (lambda v: isinstance(v, (int, float)) and not isinstance(v, bool) and v >= 0,
                   "a number of GiB (unused: a short KV pool preempts by recompute)"),
    "cpu_offload_gb": (lambda v: v == 0, "0"),
    "pipeline_parallel_size": (lambda v: v == 1, "1"),
    "data_parallel_size": (lambda v: v == 1, "1"),
    "distributed_executor_backend": (lambda v: v in (None, "mp"), "None or 'mp'"),
    "compilation_config": (lambda v: v in (None, 0) or v == {}, "None: CUDA graphs are the engine's own"),
    "hf_overrides": (_none_or_empty, "None"),
    "limit_mm_per_prompt": (_none_or_empty, "None: text only"),
    "mm_processor_kwargs": (_none_or_empty, "None: text only"),
    "enable_sleep_mode": (lambda v: not v, "False"),
    "skip_tokenizer_init": (lambda v: not v, "False"),
}


def engine_config(front_end: str, model: str | None, kwargs: Mapping[str, Any]) -> EngineConfig:
    """The EngineConfig of ``LLM(model, **kwargs)`` or ``AsyncLLM(model, **kwargs)`` (``front_end`` names
    which): no model is the embedded default; a vLLM argument this engine has no use for is taken where it asks for
    nothing (``VLLM_IDLE_ARGS``), else refused with a ValueError naming it; an unknown keyword raises a TypeError
    naming it and the knob it may have meant."""
    import difflib

    knobs = [f.name for f in attrs.fields(EngineConfig)]
    kwargs = dict(kwargs)
    for name in sorted(set(kwargs) & set(VLLM_IDLE_ARGS)):
        value = kwargs.pop(name)
        takes, expected = VLLM_IDLE_ARGS[name]
        if not takes(value):
            raise ValueError(f"{front_end}(): {name}={value!r}: a vLLM engine argument this engine has no use for; "
                             f"leave it out or pass {expected}")
    unknown = sorted(set(kwargs) - set(knobs))
    if unknown:
        near = difflib.get_close_matches(unknown[0], knobs + list(VLLM_IDLE_ARGS), n=1)
        raise TypeError(f"{front_end}(): unexpected keyword argument {unknown[0]!r}"
                        + (f" (did you mean {near[0]!r}?)" if near else "")
                        + f"; knobs are those of vtcore.config.EngineConfig: {', '.join(knobs)}")
    try:
        return EngineConfig(model=model or DEFAULT_MODEL, **kwargs)
    except TypeError as exc:
        raise TypeError(f"{front_end}(): {exc}; knobs are those of vtcore.config.EngineConfig") from None
