"""Errors in OpenAI's shape ``{"error": {"message", "type", "param", "code"}}``: the exception the
endpoints raise, the mapping of engine and validation errors onto it, and its ASGI form."""
from __future__ import annotations

import json
import logging
import re
from typing import Any, Sequence

from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse

from vtcore.errors import EngineDeadError, NotSupportedError
from vtcore.server.asgi import Send
from vtcore.server.protocol import NOT_UNICODE

log = logging.getLogger("vtcore.server")

#: pydantic error types that only say "not this member of a union" (another member's error says why)
_MISMATCHES = {"string_type", "int_type", "int_parsing", "float_type", "float_parsing", "bool_type", "bool_parsing",
               "list_type", "dict_type", "model_type", "model_attributes_type", "none_required", "literal_error"}
#: loc parts that name a union member, not a field ("str", "list[int]", "constrained-str", ...; a model's class
#: name, capitalised, as no field is)
_MEMBER_TAGS = {"str", "int", "float", "bool", "list", "dict", "none"}
_PARAM = re.compile(r"SamplingParams\.(\w+)=")


class APIError(Exception):
    """An error answered in OpenAI's shape; ``param`` names the request field at fault."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 type: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.type = type or ("invalid_request_error" if status < 500 else "server_error")

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self, headers: dict[str, str] | None = None) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=headers)


def to_api_error(exc: BaseException, renames: dict[str, str] | None = None) -> APIError:
    """Map an engine or validation exception to an APIError: 400 for a bad request (the field named
    as the client sent it, through ``renames`` of SamplingParams' names), else 500."""
    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, EngineDeadError):
        return APIError(500, str(exc), code="engine_dead")
    if isinstance(exc, (NotSupportedError, ValueError, TypeError)):
        msg, param = str(exc), None
        m = _PARAM.search(msg)
        if m:
            param = (renames or {}).get(m.group(1), m.group(1))
            msg = msg.replace(f"SamplingParams.{m.group(1)}=", f"{param}=")
        return APIError(400, msg, param, "unsupported" if isinstance(exc, NotSupportedError) else None)
    log.exception("vtcore server: unexpected error", exc_info=exc)
    return APIError(500, f"internal error: {type(exc).__name__}: {exc}")


def _is_field(part: Any) -> bool:
    return isinstance(part, int) or (re.fullmatch(r"[a-z0-9_]\w*", str(part)) is not None and part not in _MEMBER_TAGS)


def validation_error(exc: RequestValidationError, content_type: str) -> APIError:
    """FastAPI's 422 as a 400 naming the field. Of a union's errors, one that says what is wrong
    with the value (too short, out of range, not valid Unicode) beats "not a list" from the others."""
    errors = exc.errors()
    if not errors:
        return APIError(400, "invalid request body")
    first = next((e for e in errors if e.get("type") not in _MISMATCHES), errors[0])
    if first.get("type") == "json_invalid":
        cause = (first.get("ctx") or {}).get("error")  # (the parser's reason; FastAPI's msg is "JSON decode error")
        where = first.get("loc", ())[1:]
        at = f" at character {where[0]}" if where and where[0] else ""
        return APIError(400, "the request body is not valid JSON: " + (cause + at if cause else str(first.get("msg"))))
    loc = [p for p in first.get("loc", ()) if p != "body" and _is_field(p)]
    if not loc:
        hint = "" if "json" in content_type else f" sent with Content-Type: application/json (got {content_type!r})"
        return APIError(400, f"the request body: {first.get('msg')}; expected a JSON object{hint}")
    param = str(loc[0])
    where = param + "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in loc[1:])
    if param == "prompt" and first.get("type") in _MISMATCHES:
        msg = "prompt: expected a string, a list of token ids, or a list of strings or of token-id lists"
    elif first.get("type") == "string_unicode":
        msg = f"{where}: {NOT_UNICODE}"
    else:
        msg = f"{where}: {first.get('msg')} (got {first.get('input')!r:.80})"
    return APIError(400, msg, param)


def error_bytes(err: APIError) -> bytes:
    return json.dumps(err.body()).encode()


async def send_error(send: Send, err: APIError, extra_headers: Sequence[tuple[bytes, bytes]] = ()) -> None:
    """Answer ``err`` on a raw ASGI ``send`` (before any response has started)."""
    body = error_bytes(err)
    await send({"type": "http.response.start", "status": err.status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                            *extra_headers]})
    await send({"type": "http.response.body", "body": body, "more_body": False})
