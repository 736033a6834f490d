"""``JSONBodyRoute``: the app's routes parse a JSON request body with orjson, several times as fast as the
standard library on a prompt of token ids (``scripts/json_body_cost.py``; docs/BENCHMARKS.md), a cost every
served request pays before it reaches the engine.

A body orjson refuses (NaN or Infinity, a lone surrogate) is parsed by ``json`` instead, so the server
accepts and refuses what it did with ``json`` alone, with the same error for a body neither takes. (orjson
reads an integer literal past 64 bits as a float, which an integer field refuses, naming it: the protocol
turns a float into an integer only below 2**53, where the float names one.)
"""
from __future__ import annotations

import json
from typing import Any, Callable, Coroutine

import orjson
from fastapi import Request, Response
from fastapi.routing import APIRoute


class _JSONBodyRequest(Request):
    async def json(self) -> Any:
        if not hasattr(self, "_json"):
            body = await self.body()
            try:
                self._json = orjson.loads(body)
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
