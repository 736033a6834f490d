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

import json
from decimal import Decimal
from typing import Any, Callable, Coroutine

import orjson
from fastapi import Request, Response
from fastapi.routing import APIRoute

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
    """A request body's JSON document, its numbers as written (see above); ``ValueError`` if it is not JSON."""
    if _LONG_RUN in body.translate(_DIGITS_AS_D):
        return json.loads(body, parse_float=_number)
    try:
        return orjson.loads(body)
    except orjson.JSONDecodeError:
        return json.loads(body, parse_float=_number)


class _JSONBodyRequest(Request):
    async def json(self) -> Any:
        if not hasattr(self, "_json"):
            self._json = parse_body(await self.body())
        return self._json


class JSONBodyRoute(APIRoute):
    """An ``APIRoute`` whose handler reads the body through ``_JSONBodyRequest`` (FastAPI's documented way
    to change how a route reads its request)."""

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handler = super().get_route_handler()

        async def handle(request: Request) -> Response:
            return await handler(_JSONBodyRequest(request.scope, request.receive))

        return handle
