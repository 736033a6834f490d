"""The bench's HTTP client against a scripted server: events split across chunks and joined in one, a
kept-alive connection reused, a closed one reopened, an error body read whole, https refused."""
from __future__ import annotations

import asyncio
import io
import json

import pytest

from vtcore.bench.http_stream import HTTPError, StreamingConnection
from vtcore.cli.main import main


def _chunked(*pieces: bytes) -> bytes:
    return b"".join(b"%x\r\n%s\r\n" % (len(p), p) for p in pieces) + b"0\r\n\r\n"


async def _serve(responses: list[bytes], seen: list[tuple[int, dict]]) -> asyncio.AbstractServer:
    """Answers each request with the next of ``responses``; records (connection number, body) per request."""
    connections = 0

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        nonlocal connections
        connections += 1
        me = connections
        while responses:
            try:
                head = await reader.readuntil(b"\r\n\r\n")
            except asyncio.IncompleteReadError:
                break
            length = int(next(line.split(b":")[1] for line in head.split(b"\r\n")
                              if line.lower().startswith(b"content-length")))
            seen.append((me, json.loads(await reader.readexactly(length))))
            response = responses.pop(0)
            writer.write(response)
            await writer.drain()
            if b"Connection: close" in response:
                break
        writer.close()

    return await asyncio.start_server(handle, "127.0.0.1", 0)


def test_events_come_whole_across_chunks_on_a_kept_then_reopened_connection() -> None:
    ok = b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n"
    responses = [
        ok + b"\r\n" + _chunked(b'data: {"a": ', b'1}\n\ndata: {"b": 2}\n\nda', b"ta: [DONE]\n\n"),
        ok + b"Connection: close\r\n\r\n" + _chunked(b"data: x\r\n\r\n: a comment\n\n"),
        ok + b"\r\n" + _chunked(b"data: y\n\n"),
        b"HTTP/1.1 400 Bad Request\r\nContent-Length: 15\r\n\r\n" + b'{"error": "no"}',
    ]
    seen: list[tuple[int, dict]] = []

    async def run() -> list[list[bytes]]:
        server = await _serve(responses, seen)
        port = server.sockets[0].getsockname()[1]
        connection = StreamingConnection(f"http://127.0.0.1:{port}/v1/completions")
        got = [[e async for e in connection.events(json.dumps({"n": i}).encode())] for i in range(3)]
        with pytest.raises(HTTPError, match=r'HTTP 400: \{"error": "no"\}'):
            [e async for e in connection.events(json.dumps({"n": 3}).encode())]
        connection.close()
        server.close()
        return got

    got = asyncio.run(run())
    assert got == [[b'{"a": 1}', b'{"b": 2}', b"[DONE]"], [b"x"], [b"y"]]
    # the first two requests on one connection; the server closed it, so the third opened another
    assert seen == [(1, {"n": 0}), (1, {"n": 1}), (2, {"n": 2}), (2, {"n": 3})]


def test_only_plain_http_is_spoken() -> None:
    with pytest.raises(ValueError, match="https://x/v1.*expected an http:// URL"):
        StreamingConnection("https://x/v1/completions")
    assert main(["bench", "--base-url", "https://x/v1"], out=io.StringIO()) == 2  # before any connection
