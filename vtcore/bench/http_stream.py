"""The bench's HTTP client: one keep-alive HTTP/1.1 connection per stream over asyncio, a JSON body POSTed
and the response's server-sent events read as they arrive (chunked or sized bodies).

Why not httpx: its per-request and per-event overhead is the client's, not the server's, and it was what a
served run measured (docs/BENCHMARKS.md: about 0.6 ms more a round trip than a bare socket on the dev CPU,
and a client process capped near 3,000 events a second). Plain ``http://`` only: a bench measures a server
on this machine or its network, not TLS.
"""
from __future__ import annotations

import asyncio
from typing import AsyncIterator
from urllib.parse import SplitResult, urlsplit


class HTTPError(OSError):
    """A response other than 200, with its status and the start of its body (an I/O failure: the CLI reports it
    as one error line, as it does a refused connection)."""


def plain_http(url: str) -> SplitResult:
    """``url``'s parts, refused unless it is an ``http://`` URL with a host."""
    parts = urlsplit(url)
    if parts.scheme != "http" or not parts.hostname:
        raise ValueError(f"--base-url {url!r}: expected an http:// URL (the bench's client speaks plain HTTP/1.1)")
    return parts


class StreamingConnection:
    """One connection to ``url``'s host (reopened when the server closes it); ``events`` POSTs a body."""

    def __init__(self, url: str) -> None:
        parts = plain_http(url)
        self.host, self.port = parts.hostname, parts.port or 80
        self.path = parts.path or "/"
        self.head = f"POST {self.path} HTTP/1.1\r\nHost: {parts.netloc}\r\nContent-Type: application/json\r\n" \
                    "Accept: text/event-stream\r\n"
        self._reader: asyncio.StreamReader | None = None
        self._writer: asyncio.StreamWriter | None = None

    async def events(self, payload: bytes) -> AsyncIterator[bytes]:
        """POST ``payload`` (an encoded JSON body: a caller that times the server encodes it first) and yield
        each ``data:`` payload of the streamed response as it arrives (the request is written once the
        connection is open, so a caller's clock may start before this)."""
        if self._writer is None or self._writer.is_closing():
            self._reader, self._writer = await asyncio.open_connection(self.host, self.port)
        reader = self._reader
        self._writer.write(f"{self.head}Content-Length: {len(payload)}\r\n\r\n".encode() + payload)
        status, headers = await self._response_head(reader)
        chunks = self._chunked(reader) if headers.get("transfer-encoding") == "chunked" \
            else self._sized(reader, int(headers.get("content-length", 0)))
        if status != 200:
            text = b"".join([c async for c in chunks]).decode(errors="replace")
            raise HTTPError(f"POST {self.path}: HTTP {status}: {text[:300]}")
        pending, done = b"", False
        try:
            async for chunk in chunks:
                pending += chunk
                *lines, pending = pending.split(b"\n")
                for line in lines:
                    if line.startswith(b"data: "):
                        yield line[6:].rstrip(b"\r")
            done = True
        finally:  # a response left unread, or one the server ends with the connection, closes it
            if not done or headers.get("connection") == "close":
                self.close()

    async def _response_head(self, reader: asyncio.StreamReader) -> tuple[int, dict[str, str]]:
        head = (await reader.readuntil(b"\r\n\r\n")).decode("latin-1").split("\r\n")
        status = int(head[0].split(" ", 2)[1])
        headers = {}
        for line in head[1:]:
            if ":" in line:
                name, value = line.split(":", 1)
                headers[name.strip().lower()] = value.strip().lower()
        return status, headers

    @staticmethod
    async def _chunked(reader: asyncio.StreamReader) -> AsyncIterator[bytes]:
        while True:
            size = int((await reader.readuntil(b"\r\n")).split(b";", 1)[0], 16)
            if size == 0:
                await reader.readuntil(b"\r\n")  # (no trailers from the servers benched)
                return
            data = await reader.readexactly(size + 2)
            yield data[:-2]

    @staticmethod
    async def _sized(reader: asyncio.StreamReader, length: int) -> AsyncIterator[bytes]:
        if length:
            yield await reader.readexactly(length)

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()
        self._reader = self._writer = None
