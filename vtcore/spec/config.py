"""``speculative_config`` (vLLM's name and keys): which proposer, how many tokens it proposes a step.

Torch-free: the engine's config and the command line parse it.
"""
from __future__ import annotations

from typing import Any

import attrs

from vtcore.json_knobs import json_dict

#: the proposers this engine knows
METHODS = ("ngram", "draft_model", "mtp")


@attrs.frozen
class SpeculativeConfig:
    """``method``: "ngram" (prompt lookup over the request's own tokens), "draft_model" (a registered
    family proposes: ``model``, its checkpoint or hub id) or "mtp" (the target family's own
    multi-token-prediction head, loaded from the checkpoint's ``mtp.*``); ``num_speculative_tokens``: the most tokens
    proposed for one request a step (k); ``prompt_lookup_min`` / ``prompt_lookup_max``: the n-gram
    lengths an n-gram proposer matches, longest first."""

    method: str
    num_speculative_tokens: int
    prompt_lookup_min: int = 1
    prompt_lookup_max: int = 4
    model: str | None = None

    @classmethod
    def parse(cls, value: "SpeculativeConfig | dict[str, Any] | str | None") -> "SpeculativeConfig | None":
        """From a dict (or its JSON text, as ``--speculative-config`` takes it); None stays None. A bad
        key or value is refused naming it and what is expected."""
        if value is None or isinstance(value, SpeculativeConfig):
            return value
        value = json_dict("speculative_config", value, '{"method": "ngram", "num_speculative_tokens": 4}')
        known = {f.name for f in attrs.fields(cls)}
        unknown = sorted(set(value) - known)
        if unknown:
            raise ValueError(f"speculative_config: unknown key(s) {unknown}; expected some of {sorted(known)}")
        method = value.get("method")
        if method not in METHODS:
            raise ValueError(f"speculative_config: method={method!r}, expected one of {list(METHODS)}")
        for key in ("num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max"):
            v = value.get(key, 1)
            if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
                raise ValueError(f"speculative_config: {key}={v!r}, expected a positive integer")
        if "num_speculative_tokens" not in value:
            raise ValueError("speculative_config: num_speculative_tokens is required (the tokens proposed a step)")
        model = value.get("model")
        if method == "draft_model" and (not isinstance(model, str) or not model):
            raise ValueError(f"speculative_config: method='draft_model' needs model (the draft's checkpoint "
                             f"folder or hub id), got model={model!r}")
        if method != "draft_model" and model is not None:
            raise ValueError(f"speculative_config: model={model!r} is the draft of method='draft_model'; "
                             f"method={method!r} takes none")
        config = cls(**value)
        if config.prompt_lookup_min > config.prompt_lookup_max:
            raise ValueError(f"speculative_config: prompt_lookup_min={config.prompt_lookup_min} exceeds "
                             f"prompt_lookup_max={config.prompt_lookup_max}")
        return config
