"""The OpenAI and vLLM request fields that constrain the output, as ``StructuredOutputsParams``.

``response_format``: ``{"type": "json_object"}`` or ``{"type": "json_schema", "json_schema": {"name": ...,
"schema": {...}, "strict": ...}}`` (OpenAI); ``structured_outputs``: vLLM's object of one of ``json``,
``regex``, ``choice``, ``grammar``, ``json_object``. A bad one, or one xgrammar cannot compile, is a 400 naming
the field.
"""
from __future__ import annotations

import functools
import json
from typing import Any

from vtcore.server.errors import APIError
from vtcore.structured import StructuredOutputsParams
from vtcore.structured.grammar import GrammarRefused, grammar_of

RESPONSE_FORMATS = ("text", "json_object", "json_schema")


def structured_outputs(body: Any) -> StructuredOutputsParams | None:
    """The constraint a request body asks for (None: none); both fields at once is a 400."""
    extra = (body.model_extra or {}).get("structured_outputs")
    fmt = body.response_format
    asked = fmt is not None and fmt.type != "text"
    if extra is not None and asked:
        raise APIError(400, "response_format and structured_outputs both constrain the output; send one",
                       "structured_outputs")
    if extra is not None:
        if not isinstance(extra, dict):
            raise APIError(400, f"structured_outputs={extra!r}: expected an object with one of json, regex, choice, "
                                "grammar, json_object (and disable_any_whitespace)", "structured_outputs")
        try:
            params = StructuredOutputsParams(**extra)
        except (TypeError, ValueError) as exc:
            raise APIError(400, f"structured_outputs: {exc}", "structured_outputs") from None
        return checked(params, "structured_outputs")
    if not asked:
        return None
    if fmt.type == "json_object":
        return StructuredOutputsParams(json_object=True)
    spec = (fmt.model_extra or {}).get("json_schema")
    schema = spec.get("schema") if isinstance(spec, dict) else None
    if not isinstance(schema, dict):
        raise APIError(400, "response_format.json_schema.schema: expected the JSON schema object (response_format "
                            '{"type": "json_schema", "json_schema": {"name": ..., "schema": {...}}})',
                       "response_format.json_schema.schema")
    return checked(StructuredOutputsParams(json=schema), "response_format.json_schema.schema")


def checked(params: StructuredOutputsParams, field: str) -> StructuredOutputsParams:
    """``params`` once xgrammar builds its grammar; one it refuses is a 400 naming ``field`` (the request's own
    name for the constraint) with xgrammar's reason, before the request reaches the engine. Each distinct
    constraint is built once (``_refusal``): a large schema takes milliseconds, on the event loop for a light
    request, and a request may be checked more than once."""
    reason = _refusal(*params.key())
    if reason is not None:
        raise APIError(400, f"{field}: xgrammar cannot compile it: {reason}", field)
    return params


@functools.lru_cache(maxsize=256)
def _refusal(kind: str, value: str, one_layout: bool) -> str | None:
    """Why xgrammar refuses the constraint of key ``(kind, value, one_layout)`` (``StructuredOutputsParams.key``),
    or None."""
    arg = json.loads(value) if kind == "choice" else True if kind == "json_object" else value
    try:
        grammar_of(StructuredOutputsParams(**{kind: arg}, disable_any_whitespace=one_layout))
    except GrammarRefused as exc:
        return exc.reason
    return None
