"""CORS, as vLLM's server answers browsers: any origin by default (``--allowed-origins`` and the rest narrow
it), preflights answered before the API key is asked for, and the gate's own errors readable cross-origin."""
from __future__ import annotations

from typing import Iterator

import pytest
from server_harness import (API_KEY, MAX_BYTES, MODEL, ServerThread, engine, httpx, keyed_server,  # noqa: F401
                            needs_default_model, server)

from vtcore import AsyncLLM
from vtcore.cli.main import build_parser
from vtcore.server.app import build_app

pytestmark = needs_default_model
SITE = "https://ui.example"
PREFLIGHT = {"origin": SITE, "access-control-request-method": "POST",
             "access-control-request-headers": "authorization, content-type"}


def test_any_origin_by_default_and_the_gates_401_is_readable(server: ServerThread,  # noqa: F811
                                                            keyed_server: ServerThread) -> None:  # noqa: F811
    pre = httpx.options(keyed_server.url + "/v1/chat/completions", headers=PREFLIGHT)
    assert pre.status_code == 200 and pre.headers["access-control-allow-origin"] == "*"
    assert "POST" in pre.headers["access-control-allow-methods"]
    denied = httpx.get(keyed_server.url + "/v1/models", headers={"origin": SITE})
    assert denied.status_code == 401 and denied.headers["access-control-allow-origin"] == "*"
    ok = httpx.post(server.url + "/v1/completions", headers={"origin": SITE},
                    json={"model": MODEL, "prompt": "hi", "max_tokens": 1})
    assert ok.status_code == 200 and ok.headers["access-control-allow-origin"] == "*"


@pytest.fixture(scope="module")
def narrow(engine: AsyncLLM) -> Iterator[ServerThread]:  # noqa: F811
    cors = {"allow_origins": [SITE], "allow_methods": ["POST"], "allow_headers": ["content-type"]}
    with ServerThread(build_app(engine, MODEL, None, MAX_BYTES, cors=cors)) as srv:
        yield srv


def test_allowed_origins_methods_and_headers_narrow_it(narrow: ServerThread) -> None:
    pre = httpx.options(narrow.url + "/v1/completions", headers={**PREFLIGHT, "access-control-request-headers":
                                                                 "content-type"})
    assert pre.status_code == 200 and pre.headers["access-control-allow-origin"] == SITE
    for headers in ({**PREFLIGHT, "origin": "https://elsewhere.example"},
                    {**PREFLIGHT, "access-control-request-method": "DELETE"}, PREFLIGHT):  # (authorization)
        assert httpx.options(narrow.url + "/v1/completions", headers=headers).status_code == 400
    other = httpx.post(narrow.url + "/v1/completions", headers={"origin": "https://elsewhere.example"},
                       json={"model": MODEL, "prompt": "hi", "max_tokens": 1})
    assert other.status_code == 200 and "access-control-allow-origin" not in other.headers


def test_serve_takes_vllms_cors_flags() -> None:
    args = build_parser().parse_args(["serve", "--allowed-origins", f'["{SITE}"]', "--allowed-methods", '["POST"]',
                                      "--allow-credentials"])
    assert (args.allowed_origins, args.allowed_methods, args.allowed_headers, args.allow_credentials) == (
        [SITE], ["POST"], ["*"], True)
    defaults = build_parser().parse_args(["serve"])
    assert (defaults.allowed_origins, defaults.allow_credentials) == (["*"], False)
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--allowed-origins", SITE])  # not a JSON list
