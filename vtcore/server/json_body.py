"""``JSONBodyRoute``: the app's routes parse a JSON request body with orjson, several times as fast as the
standard library on a prompt of token ids (``scripts/json_body_cost.py``; docs/BENCHMARKS.md), a cost every
served request pays before it reaches the engine.

A body orjson refuses (NaN or Infinity, a lone surrogate) is parsed by ``json`` instead, so the server
accepts and refuses what it did with ``json`` alone, with the same error for a body neither takes. So is a
body with a run of 16 digits and decimal points, where a number's literal may say more than a float holds:
orjson reads an integer literal outside 64 bits as a float, rounded, which an integer field would take as another
integer (the run is found with ``bytes.translate``: a regular expression's scan cost ten times orjson's parse on
a prompt of ids; a run that is no such literal only costs the slower parse).
``json`` keeps an integer literal exact, and reads a number literal past 2**53 that its float rounds as a
``LiteralFloat`` (:mod:`vtcore.server.protocol`): an integer field takes the literal's value where it is an
integer and refuses it by name where it is not; a number field takes the float.
"""
from __future__ import annotations

import inspect
import json
import re
import typing
from decimal import Decimal
from typing import Any, Callable, Coroutine

import orjson
from fastapi import Request, Response
from fastapi.routing import APIRoute
from pydantic import BaseModel

from vtcore.server.protocol import LiteralFloat


#: each byte as b"d" if it is a digit or a decimal point, else as b" "
_DIGITS_AS_D = bytes(ord("d") if chr(i) in "0123456789." else ord(" ") for i in range(256))
#: the 16 digits a literal needs to say more than a float holds past 2**53 (the run of ``_DIGITS_AS_D`` it makes)
_LONG_RUN = b"d" * 16


def _number(literal: str) -> float:
    value = float(literal)
    if value.is_integer() and abs(value) >= 2 ** 53 and Decimal(literal) != Decimal(value):
        return LiteralFloat(value, Decimal(literal))
    return value


def parse_body(body: bytes) -> Any:
    """A request body's JSON document, its numbers as written (see above); ``json.JSONDecodeError`` saying why if
    it is not JSON (the request handler answers that as a 400 naming the cause, any other error as a vague one)."""
    if _LONG_RUN not in body.translate(_DIGITS_AS_D):
        try:
            return orjson.loads(body)
        except orjson.JSONDecodeError:
            pass
    try:
        return json.loads(body, parse_float=_number)
    except json.JSONDecodeError:
        raise
    except UnicodeDecodeError as exc:
        raise json.JSONDecodeError(f"not UTF-8 text ({exc.reason} at byte {exc.start})", "", exc.start) from None
    except RecursionError:
        raise json.JSONDecodeError("nested deeper than the parser's limit", "", 0) from None
    except ValueError as exc:  # (an integer literal past Python's 4,300 digits)
        raise json.JSONDecodeError(str(exc), "", 0) from None


class _JSONBodyRequest(Request):
    async def json(self) -> Any:
        if not hasattr(self, "_json"):
            self._json = parse_body(await self.body())
        return self._json


class JSONBodyRoute(APIRoute):
    """An ``APIRoute`` whose handler reads the body through ``_JSONBodyRequest`` (FastAPI's documented way
    to change how a route reads its request).

    A route whose endpoint is marked ``direct_json`` (the generation endpoints), takes only a JSON body model and
    the ``Request`` and returns a ``Response`` itself (``body_model``) answers a JSON body its model accepts
    without FastAPI's request handler: the body validated with the model, the endpoint called. FastAPI's
    dependency solving around that validation cost twice the validation itself on every served request
    (``scripts/server_request_cost.py``). Anything else (another content type, a body that is not JSON or that the
    model refuses) goes to FastAPI's handler, which answers it as it always has. The mark is the route author's
    word that the route is registered on the app itself: a router's dependencies, added where it is included,
    are solved by FastAPI's handler only."""

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handler = super().get_route_handler()
        self.body_model = _body_model(self)
        if self.body_model is None:
            async def handle(request: Request) -> Response:
                return await handler(_JSONBodyRequest(request.scope, request.receive))

            return handle
        model, endpoint = self.body_model, self.dependant.call  # (what an integration may have wrapped)
        body_name, request_name = self.dependant.body_params[0].name, self.dependant.request_param_name

        async def handle_json(request: Request) -> Response:
            request = _JSONBodyRequest(request.scope, request.receive)
            if _JSON_TYPE.match(request.headers.get("content-type", "")):
                try:
                    body = model.model_validate(await request.json())
                except Exception:  # noqa: BLE001 - FastAPI's handler answers it (with the same parse, cached)
                    return await handler(request)
                return await endpoint(**{body_name: body, request_name: request})
            return await handler(request)

        return handle_json


def direct_json(endpoint: Callable[..., Any]) -> Callable[..., Any]:
    """Mark an endpoint for ``JSONBodyRoute``'s direct path (see there)."""
    endpoint.direct_json = True  # type: ignore[attr-defined]
    return endpoint


#: the content types FastAPI reads as JSON, which the direct path takes (others go to FastAPI's handler)
_JSON_TYPE = re.compile(r"\s*application/json\s*(;|$)", re.IGNORECASE)


def _body_model(route: APIRoute) -> type[BaseModel] | None:
    """The body model of a route whose endpoint is marked ``direct_json`` and is ``async (body: Model, request:
    Request) -> Response``, with no dependency and no other parameter FastAPI fills in, else None."""
    dep = route.dependant
    others = (dep.websocket_param_name, dep.http_connection_param_name, dep.response_param_name,
              dep.background_tasks_param_name, dep.security_scopes_param_name)
    if (len(dep.body_params) != 1 or dep.request_param_name is None or dep.dependencies or route.dependencies
            or dep.path_params or dep.query_params or dep.header_params or dep.cookie_params
            or any(name is not None for name in others) or route.response_model is not None
            or not getattr(dep.call, "direct_json", False) or not inspect.iscoroutinefunction(dep.call)):
        return None
    field = dep.body_params[0]
    model = field.field_info.annotation
    try:
        returns = typing.get_type_hints(route.endpoint).get("return")
    except Exception:  # noqa: BLE001 - an annotation that does not resolve: FastAPI's handler
        return None
    if getattr(field.field_info, "embed", False) or not (isinstance(model, type) and issubclass(model, BaseModel)) \
            or not (isinstance(returns, type) and issubclass(returns, Response)):
        return None
    return model
