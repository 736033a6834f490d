"""What the server tests share: a uvicorn server over an app in a background thread, listening as
``vtcore serve`` listens (``listening_socket``), module-scoped fixtures (``engine``: the embedded
default model on CPU, ``offline``: an ``LLM`` over it, ``server``, ``keyed_server``, ``client``: the
real ``openai`` client) and helpers. A test module imports the fixtures it uses; each module builds
its own engine. Every socket is 127.0.0.1.
"""
from __future__ import annotations

import asyncio
import contextlib
import json
import os
import threading
import time
from typing import Any, Iterator

import pytest

pytest.importorskip("fastapi")
uvicorn = pytest.importorskip("uvicorn")
openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")

from vtcore import LLM, AsyncLLM, SamplingParams  # noqa: E402
from vtcore.config import DEFAULT_MODEL  # noqa: E402
from vtcore.server.app import build_app  # noqa: E402
from vtcore.server.serve import listening_socket  # noqa: E402

#: every server test module sets ``pytestmark = needs_default_model``
needs_default_model = pytest.mark.skipif(not os.path.exists(os.path.join(DEFAULT_MODEL, "model.safetensors")),
                                         reason="no embedded default model")

HOST = "127.0.0.1"
MODEL = "vtcore-test"
API_KEY = "sk-test-key"
MAX_BYTES = 64 * 1024
KNOBS = dict(device="cpu", num_kv_blocks=512)
REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PROMPTS = ["The meaning of life is", "A friend is", "Once upon a time", "The best thing about"]


# ------------------------------------------------------------------------------------------- fixtures
class ServerThread:
    """A uvicorn server over ``app`` on a free loopback port, in a background thread; ``config``: more of
    ``uvicorn.Config``'s options (``root_path``)."""

    def __init__(self, app: Any, **config: Any) -> None:
        self.sock = listening_socket(HOST, 0)  # as ``vtcore serve`` listens
        self.port = self.sock.getsockname()[1]
        self.url = f"http://{HOST}:{self.port}"
        self.server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="off",
                                                    timeout_graceful_shutdown=2, **config))
        self.thread = threading.Thread(target=lambda: asyncio.run(self.server.serve(sockets=[self.sock])),
                                       daemon=True)

    def __enter__(self) -> "ServerThread":
        self.thread.start()
        deadline = time.monotonic() + 20
        while not self.server.started:
            assert self.thread.is_alive() and time.monotonic() < deadline, "the server did not start"
            time.sleep(0.02)
        return self

    def __exit__(self, *exc: Any) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)
        self.sock.close()


def serve_in_thread(args: Any) -> tuple[threading.Thread, dict[str, Any], str]:
    """``cmd_serve(args)`` started on a thread: the thread, the dict its exit code lands in (``rc``), and the base
    URL the command printed once it listens."""
    import io

    from vtcore.server.serve import cmd_serve

    out, result = io.StringIO(), {}
    thread = threading.Thread(target=lambda: result.update(rc=cmd_serve(args, out)), daemon=True)
    thread.start()
    deadline = time.monotonic() + 60
    while "/v1" not in out.getvalue():
        assert thread.is_alive() and time.monotonic() < deadline, out.getvalue()
        time.sleep(0.05)
    return thread, result, out.getvalue().split(" on ")[1].split("/v1")[0]


@contextlib.contextmanager
def template_server(engine: AsyncLLM, template: str) -> Iterator[ServerThread]:
    """A server over ``engine`` whose tokenizer renders conversations with ``template`` meanwhile."""
    tokenizer = engine.engine.tokenizer
    own, tokenizer.chat_template = tokenizer.chat_template, template
    try:
        with ServerThread(build_app(engine, MODEL)) as srv:
            yield srv
    finally:
        tokenizer.chat_template = own


@pytest.fixture(scope="module")
def engine() -> Iterator[AsyncLLM]:
    eng = AsyncLLM(**KNOBS)
    yield eng
    eng.shutdown()


@pytest.fixture(scope="module")
def offline() -> LLM:
    return LLM(**KNOBS)


@pytest.fixture(scope="module")
def server(engine: AsyncLLM) -> Iterator[ServerThread]:
    with ServerThread(build_app(engine, MODEL, None, MAX_BYTES)) as srv:
        yield srv


@pytest.fixture(scope="module")
def keyed_server(engine: AsyncLLM) -> Iterator[ServerThread]:
    with ServerThread(build_app(engine, MODEL, API_KEY, MAX_BYTES)) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server: ServerThread) -> Iterator[Any]:
    with openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60) as c:
        yield c


def greedy(max_tokens: int, **kw: Any) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, **kw)


def error_of(exc: Any) -> dict[str, Any]:
    """The OpenAI-shaped error body of an ``openai.APIStatusError``."""
    body = exc.response.json()
    assert set(body) == {"error"} and {"message", "type", "param", "code"} <= set(body["error"]), body
    return body["error"]


def wait_pool_empty(engine: AsyncLLM, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        stats = engine.stats()
        if stats.kv_cache_usage == 0 and stats.num_running == stats.num_waiting == 0:
            return
        time.sleep(0.02)
    raise AssertionError(f"KV blocks not freed: {engine.stats()}")


def metric(text: str, name: str, **labels: str) -> float:
    """A sample's value from the Prometheus text (0 when absent)."""
    total = 0.0
    for line in text.splitlines():
        if line.startswith("#") or not line.startswith(name):
            continue
        series, value = line.rsplit(" ", 1)
        if series.split("{")[0] != name:
            continue
        if all(f'{k}="{v}"' in series for k, v in labels.items()):
            total += float(value)
    return total




def post_json(url: str, body: dict[str, Any], **kwargs: Any) -> Any:
    """POST ``body`` as Python's ``json.dumps`` writes it, as a client outside the openai package may:
    NaN and Infinity literals, ``\\ud800`` escapes (the openai client and httpx refuse to send them)."""
    return httpx.post(url, content=json.dumps(body).encode(), headers={"content-type": "application/json"},
                      **{"timeout": 60, **kwargs})
