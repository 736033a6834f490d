"""Dict-valued engine knobs (``speculative_config``, ``profiler_config``, ``override_generation_config``): a dict, or
its JSON text as their flags take it."""
from __future__ import annotations

import json
from typing import Any


def json_dict(name: str, value: Any, example: str) -> dict[str, Any]:
    """``value`` as a dict (parsed when it is JSON text); anything else is refused naming ``name`` and showing
    ``example``."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{name}={value!r}: not valid JSON ({exc}); expected such as {example}") from None
    if not isinstance(value, dict):
        raise ValueError(f"{name}={value!r}: expected a dict such as {example}")
    return value
