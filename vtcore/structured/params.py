"""``StructuredOutputsParams``: what a request's output must match (vLLM's names, one constraint)."""
from __future__ import annotations

import json
from typing import Any

import attrs

#: the constraints, each a field; exactly one is set
KINDS = ("json", "regex", "choice", "grammar", "json_object")


@attrs.frozen(kw_only=True)
class StructuredOutputsParams:
    """``json``: a JSON schema (a dict or its JSON text); ``regex``: a regular expression the whole
    output matches; ``choice``: the output is one of these strings; ``grammar``: an EBNF grammar
    (xgrammar's dialect, rule ``root`` first); ``json_object``: any JSON object. ``disable_any_whitespace``
    (vLLM's option, for the two JSON kinds): JSON in one layout, ``", "`` and ``": "`` between items and no
    other white space, rather than any white space the grammar allows. A bad value raises ``ValueError``
    naming the field."""

    json: str | dict[str, Any] | None = None
    regex: str | None = None
    choice: tuple[str, ...] | list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool = False

    def __attrs_post_init__(self) -> None:
        given = [k for k in KINDS if getattr(self, k) not in (None, False)]
        if len(given) != 1:
            raise ValueError(f"StructuredOutputsParams: {'no constraint' if not given else f'{given}'} given; "
                             f"expected exactly one of {list(KINDS)}")
        if self.json is not None and not isinstance(self.json, (str, dict)):
            raise ValueError(f"StructuredOutputsParams.json={self.json!r}: expected a JSON schema (a dict or JSON text)")
        if isinstance(self.json, str):
            try:
                json.loads(self.json)
            except json.JSONDecodeError as exc:
                raise ValueError(f"StructuredOutputsParams.json: not valid JSON ({exc})") from None
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise ValueError(f"StructuredOutputsParams.{name}={value!r}: expected a non-empty string")
        if self.choice is not None:
            if isinstance(self.choice, str) or not self.choice or not all(isinstance(c, str) for c in self.choice):
                raise ValueError(f"StructuredOutputsParams.choice={self.choice!r}: expected a non-empty list of strings")
            object.__setattr__(self, "choice", tuple(self.choice))
        if self.json_object not in (None, True, False):
            raise ValueError(f"StructuredOutputsParams.json_object={self.json_object!r}: expected a bool")
        if not isinstance(self.disable_any_whitespace, bool):
            raise ValueError(f"StructuredOutputsParams.disable_any_whitespace={self.disable_any_whitespace!r}: "
                             "expected a bool")

    @property
    def kind(self) -> str:
        return next(k for k in KINDS if getattr(self, k) not in (None, False))

    def key(self) -> tuple[str, str, bool]:
        """What identifies the compiled grammar (its cache key): the kind, its value as text, and whether it is
        JSON in one layout (``disable_any_whitespace`` on a JSON kind)."""
        kind = self.kind
        value = getattr(self, kind)
        if kind == "json":
            value = value if isinstance(value, str) else json.dumps(value, sort_keys=True)
        elif kind == "choice":
            value = json.dumps(list(value))
        return kind, str(value), self.disable_any_whitespace and kind in ("json", "json_object")
