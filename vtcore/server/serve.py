"""``vtcore serve``: the OpenAI-compatible server under uvicorn, with a graceful shutdown.

On SIGTERM or SIGINT the server stops accepting connections, lets in-flight requests finish for
``--shutdown-timeout`` seconds, cancels (and so aborts) whatever is still running, then shuts the
engine down and exits 0.
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import ipaddress
import json
import logging
import os
import signal
import socket
import ssl
import sys
import threading
from typing import TYPE_CHECKING, Any, Generator, Sequence, TextIO

from vtcore.config import DEFAULT_MODEL
from vtcore.engine.arg_utils import DeprecatedFlag, add_engine_args, engine_config_from_args
from vtcore.server.reasoning import REASONING_PARSERS

if TYPE_CHECKING:
    from vtcore.config import EngineConfig
    from vtcore.server.serving import Serving

DEFAULT_MAX_REQUEST_BYTES = 8 << 20
DEFAULT_MODEL_NAME = "vtcore-default"


def add_serve_parser(sub: Any) -> argparse.ArgumentParser:
    """Add the ``serve`` subcommand to ``sub`` (the parser's subparsers): ``vtcore serve [MODEL]`` and the
    engine arguments, as ``vllm serve``, with the server's own flags."""
    p = sub.add_parser("serve", help="serve the model over an OpenAI-compatible HTTP API")
    add_engine_args(p, positional_model=True)
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default: 127.0.0.1, this machine only)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--served-model-name", default=None, nargs="+", metavar="NAME",
                   help="the model names clients send (vLLM's aliases: the first is the one responses carry where a "
                        f"request names none; default: MODEL as given, or {DEFAULT_MODEL_NAME!r})")
    p.add_argument("--api-key", default=None,
                   help="require 'Authorization: Bearer KEY' on /v1/*, /tokenize, /detokenize, /reset_prefix_cache, "
                        "/start_profile and /stop_profile (default: $VTCORE_API_KEY, else none)")
    p.add_argument("--max-request-bytes", type=int, default=DEFAULT_MAX_REQUEST_BYTES,
                   help=f"largest request body accepted, else 413 (default: {DEFAULT_MAX_REQUEST_BYTES})")
    p.add_argument("--shutdown-timeout", type=float, default=5.0,
                   help="seconds in-flight requests get to finish on SIGTERM before they are aborted")
    p.add_argument("--log-level", "--uvicorn-log-level", default="info",
                   choices=["critical", "error", "warning", "info", "debug", "trace"],
                   help="uvicorn's log level (vLLM's --uvicorn-log-level; debug and trace also log each HTTP "
                        "request's line)")
    p.add_argument("--root-path", default="", metavar="PATH",
                   help="the URL prefix a proxy serves this server under (ASGI's root_path, vLLM's flag): routes "
                        "still answer at /v1/..., and /openapi.json names the prefix")
    p.add_argument("--enable-log-requests", action=argparse.BooleanOptionalAction, default=False,
                   help="log each generation request as it arrives (its id, prompt length and sampling params) and "
                        "as it ends (vLLM's flag)")
    p.add_argument("--disable-log-requests", dest="enable_log_requests", action=DeprecatedFlag, nargs=0, const=False,
                   help="deprecated (vLLM's): requests are not logged unless --enable-log-requests",
                   warning="--disable-log-requests is deprecated: requests are logged only with --enable-log-requests")
    p.add_argument("--max-log-len", type=int, default=None, metavar="N",
                   help="with --enable-log-requests, the most prompt characters and prompt token ids a request's "
                        "line shows (vLLM's flag; default: all)")
    p.add_argument("--disable-uvicorn-access-log", action="store_true",
                   help="no line a HTTP request even at --log-level debug or trace (vLLM's flag)")
    p.add_argument("--response-role", default="assistant", metavar="ROLE",
                   help="a chat reply's role where the request asks for a new message (add_generation_prompt); "
                        "otherwise the reply continues the last message, in its role (vLLM's flag and rule; "
                        "default: assistant)")
    p.add_argument("--enable-force-include-usage", action="store_true",
                   help="every streamed completion and chat carries its usage so far in each chunk and ends with "
                        "a usage chunk, whatever its stream_options ask (vLLM's flag)")
    p.add_argument("--ssl-keyfile", default=None, metavar="PATH",
                   help="the TLS private key (PEM) of --ssl-certfile, where that file does not hold it")
    p.add_argument("--ssl-certfile", default=None, metavar="PATH",
                   help="serve HTTPS: the TLS certificate (PEM; its key too, unless --ssl-keyfile)")
    p.add_argument("--ssl-ca-certs", default=None, metavar="PATH",
                   help="the CA certificates that client certificates are checked against (with --ssl-cert-reqs)")
    p.add_argument("--ssl-cert-reqs", type=int, default=int(ssl.CERT_NONE), choices=[0, 1, 2],
                   help="whether a client certificate is required: 0 none, 1 optional, 2 required "
                        "(Python's ssl.CERT_*; vLLM's flag; default: 0)")
    p.add_argument("--enable-auto-tool-choice", action="store_true",
                   help="vLLM's flag, taken for its command lines: tool calls are parsed (and tool_choice 'auto' "
                        "served) whenever the family's plugin supplies a tool-call parser")
    p.add_argument("--tool-call-parser", default=None, metavar="NAME",
                   help="vLLM's flag: the name of the family's own tool-call format (e.g. hermes for Qwen3, "
                        "qwen3_coder for Qwen3.5), checked at start; the family's plugin supplies the parser")
    p.add_argument("--reasoning-parser", default=None, choices=sorted(REASONING_PARSERS),
                   help="split a reasoning model's thinking block into the chat message's reasoning_content "
                        "(qwen3: <think>...</think>, for Qwen3 and Qwen3.5)")
    p.add_argument("--return-tokens-as-token-ids", action="store_true",
                   help="logprobs name each token 'token_id:{id}' instead of its text, unless a request's "
                        "return_tokens_as_token_ids says otherwise (vLLM's flag)")
    p.add_argument("--chat-template", default=None, metavar="PATH|TEMPLATE",
                   help="the Jinja chat template for /v1/chat/completions and /tokenize, a file or the template "
                        "itself (default: the tokenizer's)")
    for flag, what in (("origins", "origins"), ("methods", "HTTP methods"), ("headers", "request headers")):
        p.add_argument(f"--allowed-{flag}", type=_json_list, default=["*"], metavar="JSON",
                       help=f"CORS: the {what} a browser may use, a JSON list (vLLM's; default: [\"*\"])")
    p.add_argument("--allow-credentials", action="store_true", help="CORS: let browsers send credentials")
    p.add_argument("--engine-core-process", action=argparse.BooleanOptionalAction, default=True,
                   help="run the engine in a process of its own, the HTTP server in this one (vLLM V1's "
                        "EngineCore; see vtcore.engine.core_process; default); --no-engine-core-process: on a "
                        "thread of this process")
    p.set_defaults(func=cmd_serve)
    return p


#: After the grace period and the aborts, how long uvicorn still waits before it cancels what is left.
BACKSTOP_S = 5.0


def _server_class() -> type:
    import uvicorn

    class Server(uvicorn.Server):
        """uvicorn's server with a graceful shutdown that ends in a clean exit.

        On SIGTERM/SIGINT uvicorn stops accepting and waits for open connections; after ``grace``
        seconds every engine request still in flight is aborted, so each response ends properly
        (streams with finish_reason "abort" and [DONE]) rather than being cut. uvicorn's own timeout
        (grace + BACKSTOP_S) then cancels anything still stuck. The signal is not re-raised at exit.
        If the engine loop dies the server shuts down the same way and ``vtcore serve`` exits 1, so a
        supervisor restarts it (as vLLM's server exits), rather than answering 500s for ever.
        """

        def __init__(self, config: Any, serving: Serving, grace: float) -> None:
            super().__init__(config)
            self.serving = serving
            self.grace = grace
            self.engine_died = False

        async def on_tick(self, counter: int) -> bool:
            dead = self.serving.engine.dead
            if dead is not None and not self.engine_died:
                self.engine_died = True
                logging.getLogger("vtcore.server").error(
                    "vtcore serve: the engine died (%s: %s); shutting down", type(dead).__name__, dead)
                return True
            return await super().on_tick(counter)

        async def _abort_after_grace(self) -> None:
            await asyncio.sleep(self.grace)
            n = await self.serving.abort_all()
            if n:
                logging.getLogger("vtcore.server").warning(
                    "vtcore serve: grace period of %.1fs over: aborted %d request(s) in flight", self.grace, n)

        async def shutdown(self, sockets: Any = None) -> None:
            self.serving.draining = True
            aborter = asyncio.create_task(self._abort_after_grace())
            try:
                await super().shutdown(sockets)
            finally:
                aborter.cancel()

        @contextlib.contextmanager
        def capture_signals(self) -> Generator[None, None, None]:
            if threading.current_thread() is not threading.main_thread():
                yield
                return
            handled = (signal.SIGINT, signal.SIGTERM)
            original = {sig: signal.signal(sig, self.handle_exit) for sig in handled}
            try:
                yield
            finally:
                for sig, handler in original.items():
                    signal.signal(sig, handler)

    return Server


def _log_requests_to(stream: TextIO) -> None:
    """``--enable-log-requests``: the request log's INFO lines to ``stream`` (vtcore configures no root
    logger, whose default handler shows warnings only)."""
    from vtcore.server.serving import request_log as log

    if not log.handlers:
        handler = logging.StreamHandler(stream)
        handler.setFormatter(logging.Formatter("%(levelname)s %(asctime)s %(message)s"))
        log.addHandler(handler)
    log.setLevel(logging.INFO)
    log.propagate = False


def _json_list(value: str) -> list[str]:
    """A JSON list of strings (vLLM's form for the CORS flags)."""
    try:
        items = json.loads(value)
    except json.JSONDecodeError:
        items = None
    if not isinstance(items, list) or not all(isinstance(i, str) for i in items):
        raise argparse.ArgumentTypeError(f"{value!r}: expected a JSON list of strings, "
                                         "e.g. '[\"https://example.com\"]'")
    return items


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def listening_socket(host: str, port: int) -> socket.socket:
    """A listening socket on ``host:port`` (port 0: any free one); a port in use is one error line.

    It has ``TCP_NODELAY``, which the connections it accepts inherit: without it, a response written
    in pieces (headers, then body; each SSE event) waits for the client's delayed ACK (~40 ms) behind
    Nagle's algorithm, so a second request on a keep-alive connection took ~50 ms instead of ~10 and
    streams reached clients in bursts. (asyncio sets it only on sockets it creates itself.)
    """
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    try:
        sock.bind((host, port))
        sock.listen(2048)
    except OSError as exc:
        sock.close()
        raise OSError(f"--host {host} --port {port}: cannot listen there ({exc.strerror or exc})") from None
    return sock


def access_log(args: argparse.Namespace) -> bool:
    """Whether uvicorn logs a line a HTTP request: at --log-level debug or trace, unless
    --disable-uvicorn-access-log."""
    return args.log_level in ("debug", "trace") and not args.disable_uvicorn_access_log


def _tls_options(args: argparse.Namespace) -> dict[str, Any]:
    """uvicorn's TLS options from ``--ssl-*`` ({} to serve plain HTTP; the key may be in the certificate's file, as
    uvicorn takes it); a key without a certificate, or a file that cannot be used, is refused naming it before the
    model loads."""
    if args.ssl_certfile is None:
        if args.ssl_keyfile is not None:
            raise ValueError("--ssl-keyfile: expected with --ssl-certfile (the certificate it belongs to)")
        if args.ssl_ca_certs is not None or args.ssl_cert_reqs != ssl.CERT_NONE:
            raise ValueError("--ssl-ca-certs and --ssl-cert-reqs: expected with --ssl-certfile (HTTPS)")
        return {}
    try:  # (the checks uvicorn makes at its start, here before the model loads)
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        context.load_cert_chain(args.ssl_certfile, args.ssl_keyfile)
        if args.ssl_ca_certs is not None:
            context.load_verify_locations(args.ssl_ca_certs)
    except (OSError, ssl.SSLError) as exc:
        raise ValueError(f"--ssl-certfile {args.ssl_certfile!r}"
                         + (f" --ssl-keyfile {args.ssl_keyfile!r}" if args.ssl_keyfile else "")
                         + (f" --ssl-ca-certs {args.ssl_ca_certs!r}" if args.ssl_ca_certs else "")
                         + f": cannot be used ({exc})") from None
    return {"ssl_keyfile": args.ssl_keyfile, "ssl_certfile": args.ssl_certfile, "ssl_ca_certs": args.ssl_ca_certs,
            "ssl_cert_reqs": args.ssl_cert_reqs}


def _check_tool_call_parser(name: str, engine: Any) -> None:
    """``--tool-call-parser NAME`` names the served family's format (its parser's ``names``), else a ValueError
    saying which it is."""
    parser = engine.tool_parser()
    names = tuple(getattr(parser, "names", ())) if parser is not None else ()
    if name not in names:
        has = f"parses its tool calls as {' / '.join(names)}" if names else (
            "has a tool-call parser of no vLLM name" if parser is not None else "has no tool-call parser")
        raise ValueError(f"--tool-call-parser {name!r}: the served family {engine.engine.family.name!r} {has}; "
                         "expected that name, or no --tool-call-parser (its plugin supplies the parser)")


def served_model_names(args: argparse.Namespace, config: EngineConfig) -> list[str]:
    """The model names clients may send: ``--served-model-name``'s (the first is the name responses and metrics
    carry where a request names none), else the model as given, else 'vtcore-default'."""
    return args.served_model_name or [DEFAULT_MODEL_NAME if config.model == DEFAULT_MODEL else config.model]



def _event_loop_runner() -> Any:
    """``uvloop.run`` where uvloop is installed (a dependency off Windows; vLLM's server runs on it too), else
    ``asyncio.run``. uvicorn parses HTTP with httptools when it is installed (a dependency)."""
    try:
        import uvloop
    except ImportError:
        return asyncio.run
    return uvloop.run


def cmd_serve(args: argparse.Namespace, out: TextIO) -> int:
    import attrs
    import uvicorn

    from vtcore.engine.async_llm import AsyncLLM
    from vtcore.server.app import build_app
    from vtcore.server.chat import load_chat_template

    if not 0 <= args.port <= 65535:
        raise ValueError(f"--port {args.port}: expected 0..65535")
    if args.max_request_bytes <= 0:
        raise ValueError(f"--max-request-bytes {args.max_request_bytes}: expected a positive number of bytes")
    if args.shutdown_timeout < 0:
        raise ValueError(f"--shutdown-timeout {args.shutdown_timeout}: expected seconds >= 0")
    if args.root_path and not args.root_path.startswith("/"):
        raise ValueError(f"--root-path {args.root_path!r}: expected a URL path that starts with '/', e.g. /api")
    if args.max_log_len is not None and args.max_log_len < 0:
        raise ValueError(f"--max-log-len {args.max_log_len}: expected a number of characters and ids >= 0")
    tls = _tls_options(args)
    if not args.response_role:
        raise ValueError(f"--response-role {args.response_role!r}: expected a role name, such as assistant")
    config = engine_config_from_args(args)
    api_key = args.api_key or os.environ.get("VTCORE_API_KEY") or None
    names = served_model_names(args, config)
    name = names[0]
    if not _is_loopback(args.host) and api_key is None:
        out.write(f"vtcore serve: warning: listening on {args.host} without --api-key: anyone who can reach "
                  "this address can use the server\n")
    chat_template = load_chat_template(args.chat_template) if args.chat_template is not None else None
    sock = listening_socket(args.host, args.port)  # first: a port in use fails before the model loads
    try:
        engine = AsyncLLM(**attrs.asdict(config), engine_core_process=args.engine_core_process)
    except BaseException:
        sock.close()
        raise
    try:
        if args.tool_call_parser is not None:
            _check_tool_call_parser(args.tool_call_parser, engine)
        cors = {"allow_origins": args.allowed_origins, "allow_methods": args.allowed_methods,
                "allow_headers": args.allowed_headers, "allow_credentials": args.allow_credentials}
        if args.enable_log_requests:
            _log_requests_to(sys.stderr)
        app = build_app(engine, names, api_key, args.max_request_bytes, args.reasoning_parser, chat_template, cors,
                        args.return_tokens_as_token_ids, dev_mode=os.environ.get("VTCORE_SERVER_DEV_MODE") == "1",
                        log_requests=args.enable_log_requests, max_log_len=args.max_log_len,
                        response_role=args.response_role, force_include_usage=args.enable_force_include_usage)
        config = uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level,
                                timeout_graceful_shutdown=args.shutdown_timeout + BACKSTOP_S, lifespan="off",
                                access_log=access_log(args),
                                root_path=args.root_path, **tls)
        server = _server_class()(config, app.state.server, args.shutdown_timeout)
        host = f"[{args.host}]" if ":" in args.host else args.host  # the URL names the port really bound
        scheme = "https" if tls else "http"
        out.write(f"vtcore serve: model {name!r} on {scheme}://{host}:{sock.getsockname()[1]}/v1\n")
        out.flush()
        try:
            _event_loop_runner()(server.serve(sockets=[sock]))
        except SystemExit as exc:  # uvicorn exits 1 when it cannot start
            return int(exc.code or 0) if isinstance(exc.code, int) else 1
        if not server.started or server.engine_died:
            return 1
    finally:
        sock.close()
        engine.shutdown()
    out.write("vtcore serve: stopped\n")
    out.flush()
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    from vtcore.errors import VtcoreError

    parser = argparse.ArgumentParser(prog="vtcore")
    add_serve_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["serve", *(sys.argv[1:] if argv is None else argv)])
    logging.basicConfig(level=logging.WARNING)
    try:
        return args.func(args, sys.stdout)
    except (VtcoreError, ValueError, TypeError, OSError, NotImplementedError) as exc:
        sys.stderr.write(f"vtcore serve: error: {exc}\n")
        return 2


if __name__ == "__main__":
    sys.exit(main())
