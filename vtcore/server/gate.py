"""``Gate``: the ASGI middleware in front of every route: bearer auth, the request-size limit (413)
and counting the HTTP answers for ``/metrics``."""
from __future__ import annotations

import hmac
from typing import Any

from vtcore.server.asgi import ASGIApp, Receive, Scope, Send
from vtcore.server.errors import APIError, send_error
from vtcore.server.metrics import ServerMetrics

#: A body over the limit is still read (and dropped) up to this much more, so that the client, which
#: writes its whole body before it reads, sees the 413 instead of a reset connection.
DRAIN_BYTES = 8 << 20
#: Paths that need the API key when one is set: the OpenAI API, vLLM's tokenizer endpoints, its prefix-cache reset
#: and its profiler switches.
GUARDED_PREFIXES = ("/v1", "/tokenize", "/detokenize", "/reset_prefix_cache", "/start_profile", "/stop_profile")


def route_path(scope: Scope) -> str:
    """The path the routes match: the request's path less the ASGI ``root_path`` (``vtcore serve --root-path``)
    that the server puts in front of it, by starlette's own rule (its router's ``get_route_path``): so that the
    guard and the metrics see exactly the route a request reaches under any prefix."""
    path, root = scope.get("path", ""), scope.get("root_path", "")
    if not root or not path.startswith(root):
        return path
    if path == root:
        return ""
    return path[len(root):] if path[len(root)] == "/" else path


class Gate:
    """Bearer auth on ``GUARDED_PREFIXES``, the body-size limit, and one count per answer by
    endpoint (``endpoints``; any other path counts as "other") and status (499: no answer)."""

    def __init__(self, app: ASGIApp, api_key: str | None, max_request_bytes: int, metrics: ServerMetrics,
                 endpoints: frozenset[str]) -> None:
        self.app = app
        self.api_key = api_key.encode() if api_key else None
        self.max_bytes = max_request_bytes
        self.metrics = metrics
        self.endpoints = endpoints

    def _authorized(self, headers: dict[bytes, bytes]) -> bool:
        auth = headers.get(b"authorization", b"")
        scheme, _, token = auth.partition(b" ")
        return scheme.lower() == b"bearer" and hmac.compare_digest(token.strip(), self.api_key)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path = route_path(scope)
        status = [0]

        async def counted_send(message: dict[str, Any]) -> None:
            if message["type"] == "http.response.start":
                status[0] = message["status"]
            await send(message)

        try:
            await self._handle(scope, receive, counted_send)
        finally:
            self.metrics.http(path if path in self.endpoints else "other", status[0] or 499)

    async def _handle(self, scope: Scope, receive: Receive, send: Send) -> None:
        headers = dict(scope.get("headers") or [])
        guarded = route_path(scope).startswith(GUARDED_PREFIXES) and scope.get("method") != "OPTIONS"
        if self.api_key is not None and guarded and not self._authorized(headers):
            await send_error(send, APIError(401, "invalid or missing API key: send the header "
                                                 "'Authorization: Bearer <key>'", code="invalid_api_key"),
                             [(b"www-authenticate", b"Bearer")])
            return
        if scope.get("method") in ("GET", "HEAD", "OPTIONS", "DELETE"):
            await self.app(scope, receive, send)
            return
        declared = headers.get(b"content-length")
        if declared is not None:
            if not declared.strip().isdigit():
                await send_error(send, APIError(400, f"Content-Length {declared!r}: expected a number of bytes"))
                return
            if int(declared) > self.max_bytes + DRAIN_BYTES:  # too big even to drain: answer and close
                await send_error(send, self._too_large(int(declared)))
                return
        body, more, total = [], True, 0
        while more:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            chunk = message.get("body", b"")
            total += len(chunk)
            if total <= self.max_bytes:
                body.append(chunk)
            elif total > self.max_bytes + DRAIN_BYTES:
                break
            more = message.get("more_body", False)
        if total > self.max_bytes:
            await send_error(send, self._too_large(total))
            return
        replayed = False

        async def replay() -> dict[str, Any]:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": b"".join(body), "more_body": False}
            return await receive()

        await self.app(scope, replay, send)

    def _too_large(self, size: int) -> APIError:
        return APIError(413, f"request body of {size} bytes or more is over the limit of {self.max_bytes} bytes "
                             "(--max-request-bytes)", code="request_too_large")
