"""Checkpoint config (config.json, read without transformers) and the engine's knobs."""
from __future__ import annotations

import json
import os
from typing import Any

import attrs

from vtcore.errors import ConfigError, MissingConfigField

DEFAULT_MODEL = os.path.join(os.path.dirname(__file__), "default_model")


#: fields a decoder reads as sizes, checked where present (a family may name its sizes otherwise)
_POSITIVE_INTS = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
                  "head_dim", "intermediate_size", "max_position_embeddings", "moe_intermediate_size", "num_experts",
                  "num_experts_per_tok")


class HFConfig:
    """Attribute access over a config.json dict; ``text_config`` is flattened in when present."""

    def __init__(self, data: dict[str, Any]) -> None:
        self.raw = dict(data)
        merged = dict(data)
        if isinstance(data.get("text_config"), dict):
            merged.update(data["text_config"])
            merged["architectures"] = data.get("architectures")
            if "tie_word_embeddings" in data:  # transformers ties a multimodal model by its top-level key
                merged["tie_word_embeddings"] = data["tie_word_embeddings"]
        self._data = merged

    @classmethod
    def from_path(cls, model: str) -> "HFConfig":
        path = os.path.join(model, "config.json")
        if not os.path.isfile(path):
            raise FileNotFoundError(f"model={model!r}: expected a checkpoint folder with config.json, found none")
        try:
            with open(path) as f:
                return cls(json.load(f))
        except json.JSONDecodeError as exc:
            raise ValueError(f"{path}: not valid JSON ({exc})") from exc

    def __getattr__(self, name: str) -> Any:
        try:
            return self.__dict__["_data"][name]
        except KeyError:
            raise MissingConfigField(f"config.json has no field {name!r}, which the model needs") from None

    def validate(self) -> None:
        """Check the sizes and constants decoders read, where present, so a bad value is named here
        rather than failing deep inside a layer or torch (zero heads divided by zero, a negative
        vocabulary made a negative-size tensor, a negative rope_theta generated NaNs)."""
        data = self._data
        for name in _POSITIVE_INTS:
            value = data.get(name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value <= 0):
                raise ConfigError(f"config.json: {name}={value!r}, expected a positive integer")
        heads, kv, hidden = data.get("num_attention_heads"), data.get("num_key_value_heads"), data.get("hidden_size")
        if heads and kv and heads % kv:
            raise ConfigError(f"config.json: num_key_value_heads={kv}, expected a divisor of "
                              f"num_attention_heads={heads}")
        if heads and hidden and data.get("head_dim") is None and hidden % heads:
            raise ConfigError(f"config.json: hidden_size={hidden} is not a multiple of num_attention_heads={heads} "
                              "and no head_dim is given")
        rope = data.get("rope_parameters") if isinstance(data.get("rope_parameters"), dict) else {}
        for name, value in (("rms_norm_eps", data.get("rms_norm_eps")),
                            ("rope_theta", rope.get("rope_theta", data.get("rope_theta")))):
            if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))
                                      or not 0 < value < float("inf")):
                raise ConfigError(f"config.json: {name}={value!r}, expected a positive finite number")
        top_k, experts = data.get("num_experts_per_tok"), data.get("num_experts")
        if top_k is not None and experts is not None and top_k > experts:
            raise ConfigError(f"config.json: num_experts_per_tok={top_k}, expected at most num_experts={experts}")

    def get(self, name: str, default: Any = None) -> Any:
        return self._data.get(name, default)

    def to_dict(self) -> dict[str, Any]:
        return dict(self._data)

    @property
    def architecture(self) -> str:
        archs = self._data.get("architectures")
        if not archs or not isinstance(archs, list):
            raise ValueError(f"config.json: 'architectures' is {archs!r}, expected a list naming the model class")
        return archs[0]

    @property
    def head_dim(self) -> int:
        return self._data.get("head_dim") or self.hidden_size // self.num_attention_heads

    @property
    def rope_theta(self) -> float:
        params = self._data.get("rope_parameters") or {}
        return float(params.get("rope_theta", self._data.get("rope_theta", 10000.0)))

    @property
    def rope_parameters(self) -> dict[str, Any]:
        """HF's ``rope_parameters`` (transformers 5) or ``rope_scaling`` (4.x), or {} for plain RoPE."""
        return dict(self._data.get("rope_parameters") or self._data.get("rope_scaling") or {})

    @property
    def eos_token_ids(self) -> list[int]:
        eos = self._data.get("eos_token_id")
        return [] if eos is None else list(eos) if isinstance(eos, list) else [eos]


def _positive(instance: Any, attribute: attrs.Attribute, value: Any) -> None:
    if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value <= 0):
        raise ValueError(f"{attribute.name}={value!r}: expected a positive integer")


def _fraction(instance: Any, attribute: attrs.Attribute, value: float) -> None:
    if not 0.0 < value <= 1.0:
        raise ValueError(f"{attribute.name}={value!r}: expected a fraction in (0, 1]")


def _bool(instance: Any, attribute: attrs.Attribute, value: Any) -> None:
    if value is not None and not isinstance(value, bool):  # "off" would read as true
        raise ValueError(f"{attribute.name}={value!r}: expected True or False"
                         + (" (or None: the family decides)" if attribute.name == "async_scheduling" else ""))


def _generation_config(instance: Any, attribute: attrs.Attribute, value: Any) -> None:
    if value not in ("auto", "vllm"):
        raise ValueError(f"{attribute.name}={value!r}: expected 'auto' (the checkpoint's generation_config.json "
                         "sampling defaults) or 'vllm' (SamplingParams' own)")


@attrs.define(kw_only=True)
class EngineConfig:
    """The engine's knobs (vLLM's names). ``None`` means "derive from the checkpoint or device"."""

    model: str = DEFAULT_MODEL
    tokenizer: str | None = None
    device: str | None = None
    dtype: str = "auto"
    load_format: str = "auto"
    seed: int = 0
    max_model_len: int | None = attrs.field(default=None, validator=_positive)
    max_num_seqs: int = attrs.field(default=256, validator=_positive)
    max_num_batched_tokens: int | None = attrs.field(default=None, validator=_positive)
    block_size: int = attrs.field(default=16, validator=_positive)
    num_kv_blocks: int | None = attrs.field(default=None, validator=_positive)
    gpu_memory_utilization: float = attrs.field(default=0.9, validator=_fraction)
    enforce_eager: bool = attrs.field(default=False, validator=_bool)
    async_scheduling: bool | None = attrs.field(default=None, validator=_bool)  # None: on for families that consume
    # device tokens
    #: async scheduling with the device mirror (two steps in flight), or the rollback (False: the host
    #: waits for each step's tokens); None reads VTCORE_ASYNC_DEVICE_MIRROR (default 1: on)
    async_device_mirror: bool | None = attrs.field(default=None, validator=_bool)
    #: "auto": the checkpoint's generation_config.json sampling values are the defaults of requests
    #: that leave them unset (vLLM's default); "vllm": SamplingParams' own defaults
    generation_config: str = attrs.field(default="auto", validator=_generation_config)
