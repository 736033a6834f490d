"""Checkpoint config (config.json, read without transformers) and the engine's knobs."""
from __future__ import annotations

import json
import os
from typing import Any

import attrs

DEFAULT_MODEL = os.path.join(os.path.dirname(__file__), "default_model")


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
            raise AttributeError(f"config has no field {name!r}") from None

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
    enforce_eager: bool = False
    async_scheduling: bool | None = None  # None: on for families that consume device tokens
