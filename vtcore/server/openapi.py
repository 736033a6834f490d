"""``/openapi.json`` as the server really answers: errors are 400s (never FastAPI's 422) in OpenAI's
shape, the generation endpoints answer JSON or an SSE stream, ``/metrics`` is text/plain, and the
request schemas carry the bounds of this engine (see ``protocol.bounded``)."""
from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi

from vtcore.server.protocol import ErrorResponse

_ERRORS = {
    400: "A bad request: the message says what is wrong and `param` names the field.",
    401: "No valid API key (`Authorization: Bearer <key>`); only when the server has one.",
    404: "An unknown model (`param`: model) or path.",
    409: "The profiler is already recording (start), or is not (stop).",
    413: "The body is over the server's size limit.",
    500: "The engine failed (`code`: engine_dead when its loop died).",
    503: "The server is shutting down.",
}
#: FastAPI documents its own validation error, which the server answers as a 400 instead
_FASTAPI_VALIDATION = ("HTTPValidationError", "ValidationError")


def errors(*statuses: int) -> dict[int | str, dict[str, Any]]:
    """The ``responses`` of a route for these error statuses, each in OpenAI's error shape."""
    return {status: {"model": ErrorResponse, "description": _ERRORS[status]} for status in statuses}


def json_or_stream(description: str) -> dict[int | str, dict[str, Any]]:
    """The 200 of a generation endpoint: a JSON body, or with ``"stream": true`` server-sent events."""
    return {200: {"description": description, "content": {
        "application/json": {"schema": {"type": "object"}},
        # each event (OpenAPI 3.2's reading of an event stream, as schemathesis checks it): its data is a
        # chunk's JSON, the last one ``[DONE]``
        "text/event-stream": {"schema": _SSE_EVENT}}}}


_SSE_EVENT = {"type": "object", "required": ["data"], "description": "`data: <chunk JSON>` events, then `data: [DONE]`",
              "properties": {"data": {"type": "string"}, "event": {"type": "string"}, "id": {"type": "string"}}}


def openapi_document(app: FastAPI) -> dict[str, Any]:
    """The app's OpenAPI document, built once: FastAPI's, less the 422 it never answers."""
    if app.openapi_schema is None:
        doc = get_openapi(title=app.title, version=app.version, description=app.description, routes=app.routes)
        for operations in doc.get("paths", {}).values():
            for operation in operations.values():
                operation.get("responses", {}).pop("422", None)
        schemas = doc.get("components", {}).get("schemas", {})
        for name in _FASTAPI_VALIDATION:
            schemas.pop(name, None)
        app.openapi_schema = _exact_bounds(doc)
    return app.openapi_schema


#: the keywords of a numeric bound
_BOUNDS = frozenset({"minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf"})


def _exact_bounds(node: Any) -> Any:
    """``node`` with its whole-number bounds written as integers: FastAPI's document models type every bound
    as a float, and a client generating or checking a 64-bit field against 9.223372036854776e+18 in float
    arithmetic lets through ids past it (the seed's ``2**63``), which the server then refuses."""
    if isinstance(node, dict):
        return {k: int(v) if k in _BOUNDS and isinstance(v, float) and v.is_integer() else _exact_bounds(v)
                for k, v in node.items()}
    if isinstance(node, list):
        return [_exact_bounds(v) for v in node]
    return node
