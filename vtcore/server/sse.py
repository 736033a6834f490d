"""Server-sent events: ``EventStream`` (the streaming response), ``sse`` (one event), ``compact_json`` (an
event's data) and ``wait_disconnect`` (the client going away)."""
from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from typing import Any, AsyncIterator, Coroutine

import orjson
from fastapi.responses import Response

from vtcore.server.asgi import Receive, Scope, Send
from vtcore.server.errors import send_error, to_api_error

log = logging.getLogger("vtcore.server")


DONE = b"data: [DONE]\n\n"


def compact_json(obj: Any) -> bytes:
    """``obj`` as compact UTF-8 JSON: by orjson (a stream encodes an event a token), or by ``json`` for what
    orjson refuses (a lone surrogate, which it escapes; an integer past 64 bits; a float subclass; a key not a
    string). A non-finite float would be ``null`` (orjson's); none reaches an event: logprobs are made finite and
    the request fields an event echoes refuse one."""
    try:
        return orjson.dumps(obj)
    except orjson.JSONEncodeError:
        return json.dumps(obj, separators=(",", ":")).encode()


def sse(obj: Any) -> bytes:
    """One ``data:`` event holding ``obj`` as compact JSON."""
    return b"data: " + compact_json(obj) + b"\n\n"


async def wait_disconnect(receive: Receive) -> None:
    """Return once the client has gone away."""
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return


async def unless_disconnected(work: Coroutine[Any, Any, None], receive: Receive) -> asyncio.Task[None]:
    """Run ``work`` until it ends or the client goes away, which cancels it; returns its (done) task."""
    task = asyncio.create_task(work)
    watch = asyncio.create_task(wait_disconnect(receive))
    try:
        await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for t in (task, watch):
            t.cancel()
        await asyncio.gather(task, watch, return_exceptions=True)
    return task


class EventStream(Response):
    """An SSE response over an async iterator of events (``sse`` bytes).

    Headers go out with the first event, so an error raised before it is a plain JSON error response;
    a later one becomes an ``error`` event before ``[DONE]``. A client disconnect cancels the
    iterator (and so aborts its engine requests).
    """

    media_type = "text/event-stream"

    def __init__(self, events: AsyncIterator[bytes]) -> None:  # noqa: D107 - no body of its own
        self.events = events
        self.status_code = 200
        self.background = None
        self.raw_headers = [(b"content-type", b"text/event-stream; charset=utf-8"), (b"cache-control", b"no-cache"),
                            (b"x-accel-buffering", b"no")]

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            pump = await unless_disconnected(self._pump(send), receive)
        finally:
            with contextlib.suppress(Exception):
                await self.events.aclose()  # type: ignore[attr-defined]
        if not pump.cancelled() and pump.exception() is not None:
            exc = pump.exception()
            if not isinstance(exc, OSError):
                log.error("vtcore server: stream failed: %s: %s", type(exc).__name__, exc)

    async def _pump(self, send: Send) -> None:
        it = self.events.__aiter__()
        try:
            first = await it.__anext__()
        except StopAsyncIteration:
            first = None
        except Exception as exc:  # noqa: BLE001 - before the headers: a plain error response
            await send_error(send, to_api_error(exc))
            return
        await send({"type": "http.response.start", "status": 200, "headers": self.raw_headers})
        if first is not None:
            await send({"type": "http.response.body", "body": first, "more_body": True})
            try:
                async for event in it:
                    await send({"type": "http.response.body", "body": event, "more_body": True})
            except Exception as exc:  # noqa: BLE001 - after the headers: an error event
                err = sse(to_api_error(exc).body()) + DONE
                await send({"type": "http.response.body", "body": err, "more_body": True})
        await send({"type": "http.response.body", "body": b"", "more_body": False})
