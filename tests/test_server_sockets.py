"""The server's sockets have TCP_NODELAY. Without it a response written in pieces (headers, then the
body; each SSE event) waits behind Nagle's algorithm for the client's delayed ACK: a second request
on a keep-alive connection took ~60 ms where a fresh connection took ~20 (Linux starts a connection
acknowledging at once), and streams reached clients in bursts."""
from __future__ import annotations

import http.client
import json
import socket
import statistics
import time

from server_harness import HOST, MODEL, ServerThread, engine, needs_default_model, server  # noqa: F401

from vtcore.server.serve import listening_socket

pytestmark = needs_default_model

BODY = json.dumps({"model": MODEL, "prompt": "Hi", "max_tokens": 1, "temperature": 0})


def _timed(conn: http.client.HTTPConnection) -> float:
    """Seconds for one 1-token completion on ``conn``, answer read in full."""
    started = time.perf_counter()
    conn.request("POST", "/v1/completions", BODY, {"content-type": "application/json"})
    r = conn.getresponse()
    assert r.status == 200, r.read()
    r.read()
    return time.perf_counter() - started


def test_a_keep_alive_request_is_no_slower_than_one_on_a_fresh_connection(server: ServerThread) -> None:
    kept = http.client.HTTPConnection(HOST, server.port, timeout=30)
    _timed(kept)  # the connection's first request
    fresh, again = [], []
    for _ in range(11):  # interleaved, so both see the same load
        conn = http.client.HTTPConnection(HOST, server.port, timeout=30)
        fresh.append(_timed(conn))
        conn.close()
        again.append(_timed(kept))
    kept.close()
    assert statistics.median(again) <= 1.5 * statistics.median(fresh), (again, fresh)


def test_accepted_connections_have_tcp_nodelay() -> None:
    listener = listening_socket(HOST, 0)
    with listener, socket.create_connection(listener.getsockname()) as _client:
        accepted, _ = listener.accept()
        with accepted:
            assert accepted.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY) != 0
