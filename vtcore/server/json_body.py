"""``JSONBodyRoute``: the app's routes parse a JSON request body with orjson, several times as fast as the
standard library on a prompt of token ids (``scripts/json_body_cost.py``; docs/BENCHMARKS.md), a cost every
served request pays before it reaches the engine.

A body orjson refuses (NaN or Infinity, a lone surrogate) is parsed by ``json`` instead, so the server
accepts and refuses what it did with ``json`` alone, with the same error for a body neither takes. So is a
body with a run of 19 digits or more: orjson reads an integer literal outside 64 bits as a float, rounded,
which an integer field would take as another integer (``json`` keeps it exact, so a range refuses it by name).
"""
from __future__ import annotations

import json
import re
from typing import Any, Callable, Coroutine

import orjson
from fastapi import Request, Response
from fastapi.routing import APIRoute


#: a run of digits an integer literal outside 64 bits needs (or a long fraction, which either parser reads alike)
_LONG_NUMBER = re.compile(rb"\d{19}")


class _JSONBodyRequest(Request):
    async def json(self) -> Any:
        if not hasattr(self, "_json"):
            body = await self.body()
            try:
                self._json = json.loads(body) if _LONG_NUMBER.search(body) else orjson.loads(body)
            except orjson.JSONDecodeError:
                self._json = json.loads(body)
        return self._json


class JSONBodyRoute(APIRoute):
    """An ``APIRoute`` whose handler reads the body through ``_JSONBodyRequest`` (FastAPI's documented way
    to change how a route reads its request)."""

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handler = super().get_route_handler()

        async def handle(request: Request) -> Response:
            return await handler(_JSONBodyRequest(request.scope, request.receive))

        return handle
