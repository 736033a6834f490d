"""The OpenAI-compatible HTTP front end over ``AsyncLLM`` (vLLM's shape): ``build_app`` and its routes.

``POST /v1/completions``, ``POST /v1/chat/completions`` and ``POST /v1/responses`` (each with SSE streaming),
``GET /v1/models``,
vLLM's ``POST /tokenize`` and ``POST /detokenize``, ``GET /health`` (and vLLM's ``/ping``), ``GET /metrics``,
``GET /version``
and ``GET /openapi.json``; with ``dev_mode`` (``vtcore serve`` under ``VTCORE_SERVER_DEV_MODE=1``, as vLLM's
``VLLM_SERVER_DEV_MODE``) also vLLM's ``POST /reset_prefix_cache`` (benchmarks that start each run cold); with an
engine given a ``profiler_config``, vLLM's ``POST /start_profile`` and ``POST /stop_profile`` (a torch.profiler
trace of the steps between them, written to the configured folder).

- Every error has OpenAI's shape ``{"error": {"message", "type", "param", "code"}}``; a bad field is a
  400 naming it (FastAPI's own 422 is turned into that 400), an unknown model a 404.
- The server uses the engine's front end only (``generate``, ``abort``, ``tokenize``, ``limits``,
  ``stats``, ``healthy``, ...; ``vtcore.engine.front_end``), never its scheduler or pool.
- ``api_key`` guards ``/v1/*``, ``/tokenize`` and ``/detokenize`` with bearer auth (401); bodies over
  ``max_request_bytes`` get 413.
"""
# No ``from __future__ import annotations``: the routes' body annotations are classes built here (the
# request models bounded by this engine), which FastAPI must see as objects, not names.
from importlib.metadata import PackageNotFoundError, version as dist_version
from typing import TYPE_CHECKING, Any, Sequence

from fastapi import FastAPI, Query, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.middleware.cors import CORSMiddleware
from starlette.routing import Route

from vtcore import __version__
from vtcore.errors import ProfilerStateError
from vtcore.server.chat import ChatEndpoint
from vtcore.server.completions import CompletionsEndpoint
from vtcore.server.errors import APIError, to_api_error, validation_error
from vtcore.server.gate import Gate
from vtcore.server.json_body import JSONBodyRoute, direct_json
from vtcore.server.metrics import CONTENT_TYPE
from vtcore.server.openapi import errors, json_or_stream, openapi_document
from vtcore.server.protocol import (ChatCompletionRequest, CompletionRequest, DetokenizeRequest, DetokenizeResponse,
                                    TokenizeRequest, TokenizeResponse, bounded)
from vtcore.server.reasoning import REASONING_PARSERS
from vtcore.server.responses import ResponsesEndpoint
from vtcore.server.responses_protocol import ResponsesRequest, without_logprobs
from vtcore.server.serving import Serving
from vtcore.server.tokenization import Tokenization

if TYPE_CHECKING:
    from vtcore.engine.async_llm import AsyncLLM

#: the errors any generation or tokenization request may get
_REQUEST_ERRORS = errors(400, 401, 404, 413, 500, 503)


def _add_error_handlers(app: FastAPI) -> None:
    """Every error the app answers, in OpenAI's shape."""

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError) -> JSONResponse:
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        return validation_error(exc, request.headers.get("content-type", "")).response()

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code)
        headers = dict(exc.headers or {})
        if exc.status_code == 405:  # every method of the path's routes (Starlette names the first route's only)
            methods = {m for r in request.app.routes if isinstance(r, Route) and r.path_regex.match(request.url.path)
                       for m in r.methods or ()}
            headers["Allow"] = ", ".join(sorted(methods))
        return APIError(exc.status_code, f"{request.method} {request.url.path}: {exc.detail}", code=code).response(
            headers)

    @app.exception_handler(Exception)
    async def _crash(request: Request, exc: Exception) -> JSONResponse:
        return to_api_error(exc).response()


async def _profile(call: Any) -> None:
    """A profiler call; starting while recording, or stopping while not, is a 409 saying so (any other failure is
    the engine's: a 500)."""
    try:
        await call()
    except ProfilerStateError as exc:
        raise APIError(409, str(exc), code="conflict") from None


#: vLLM's CORS defaults (``--allowed-origins`` and the rest): any origin, method and header, no credentials
DEFAULT_CORS: dict[str, Any] = {"allow_origins": ["*"], "allow_methods": ["*"], "allow_headers": ["*"],
                                "allow_credentials": False}


def build_app(engine: "AsyncLLM", served_model_name: str | Sequence[str], api_key: str | None = None,
              max_request_bytes: int = 8 << 20, reasoning_parser: str | None = None,
              chat_template: str | None = None, cors: dict[str, Any] | None = None,
              return_tokens_as_token_ids: bool = False, dev_mode: bool = False,
              log_requests: bool = False, *, max_log_len: int | None = None, response_role: str = "assistant",
              force_include_usage: bool = False) -> FastAPI:
    """The OpenAI-compatible app over ``engine``; see the module docstring. ``app.state.server`` is
    its ``Serving`` (draining, ``abort_all``: ``vtcore serve``'s graceful shutdown uses them).
    ``reasoning_parser``: a name of :data:`vtcore.server.reasoning.REASONING_PARSERS` (None: off);
    ``chat_template``: a Jinja chat template for every conversation (None: the tokenizer's); ``cors``:
    ``CORSMiddleware``'s options over ``DEFAULT_CORS`` (outermost: a browser reads the gate's 401 and 413 too);
    ``return_tokens_as_token_ids``: logprobs name tokens ``token_id:{id}`` where a request leaves the field out;
    ``dev_mode``: also the development endpoints (the module docstring); ``log_requests``: a line of
    ``vtcore.server.serving.request_log`` as each generation request arrives (its prompt's first ``max_log_len``
    characters and ids; None: all) and as it ends; ``response_role``: a chat reply's role where the request asks for
    a new message (vLLM's); ``force_include_usage``: every streamed completion and chat carries its usage in each chunk
    and ends with a usage chunk, whatever its ``stream_options`` (vLLM's)."""
    if max_log_len is not None and (isinstance(max_log_len, bool) or not isinstance(max_log_len, int)
                                    or max_log_len < 0):
        raise ValueError(f"max_log_len={max_log_len!r}: expected a number of characters and ids >= 0, or None (all)")
    if not isinstance(response_role, str) or not response_role:
        raise ValueError(f"response_role={response_role!r}: expected a role name, such as 'assistant'")
    if not isinstance(max_request_bytes, int) or max_request_bytes <= 0:
        raise ValueError(f"max_request_bytes={max_request_bytes!r}: expected a positive number of bytes")
    if reasoning_parser is not None and reasoning_parser not in REASONING_PARSERS:
        raise ValueError(f"reasoning_parser={reasoning_parser!r}: expected one of {sorted(REASONING_PARSERS)}")
    serving = Serving(engine, served_model_name, chat_template, return_tokens_as_token_ids, log_requests,
                      max_log_len=max_log_len, response_role=response_role, force_include_usage=force_include_usage)
    parser = REASONING_PARSERS[reasoning_parser] if reasoning_parser else None
    completions, chat, tokenization = CompletionsEndpoint(serving), ChatEndpoint(serving, parser), Tokenization(serving)
    responses = ResponsesEndpoint(serving, parser)
    CompletionBody = bounded(CompletionRequest, serving.limits)
    ChatBody = bounded(ChatCompletionRequest, serving.limits)
    ResponsesBody = bounded(ResponsesRequest, serving.limits)
    if parser is not None:
        ResponsesBody = without_logprobs(ResponsesBody)
    DetokenizeBody = bounded(DetokenizeRequest, serving.limits)
    app = FastAPI(title="vtcore", version=__version__, docs_url=None, redoc_url=None, openapi_url="/openapi.json",
                  description=f"OpenAI-compatible API (vLLM's shape) serving {serving.name!r}.")
    app.openapi = lambda: openapi_document(app)  # type: ignore[method-assign]
    app.state.server = serving
    app.router.route_class = JSONBodyRoute
    _add_error_handlers(app)

    @app.post("/v1/completions", response_model=None, responses={
        **json_or_stream("A text_completion, or its chunks when streamed."), **_REQUEST_ERRORS})
    @direct_json
    async def create_completion(body: CompletionBody, request: Request) -> Response:
        return await completions(body, request)

    @app.post("/v1/chat/completions", response_model=None, responses={
        **json_or_stream("A chat.completion, or its chunks when streamed."), **_REQUEST_ERRORS})
    @direct_json
    async def create_chat_completion(body: ChatBody, request: Request) -> Response:
        return await chat(body, request)

    @app.post("/v1/responses", response_model=None, responses={
        **json_or_stream("A response, or its typed events (`event: response.created`, ...) when streamed."),
        **_REQUEST_ERRORS})
    @direct_json
    async def create_response(body: ResponsesBody, request: Request) -> Response:
        return await responses(body, request)

    @app.post("/tokenize", responses=_REQUEST_ERRORS)
    async def tokenize(body: TokenizeRequest) -> TokenizeResponse:
        return await tokenization.tokenize(body)

    @app.post("/detokenize", responses=_REQUEST_ERRORS)
    async def detokenize(body: DetokenizeBody) -> DetokenizeResponse:
        return await tokenization.detokenize(body)

    @app.get("/v1/models", responses=errors(401))
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [serving.model_card(name) for name in serving.names]}

    @app.get("/v1/models/{model:path}", responses=errors(401, 404))
    async def model(model: str) -> dict[str, Any]:
        serving.check_model(model)
        return serving.model_card(model)

    @app.get("/health", responses=errors(503))
    @app.get("/ping", responses=errors(503), description="vLLM's (SageMaker's health check): as /health.")
    @app.post("/ping", responses=errors(503), description="vLLM's (SageMaker's health check): as /health.")
    async def health() -> dict[str, str]:
        if not serving.healthy:
            raise APIError(503, "the server is shutting down or its engine is not running", code="unavailable")
        return {"status": "ok"}

    @app.get("/version")
    async def version() -> dict[str, str]:
        try:
            return {"version": dist_version("vtcore")}
        except PackageNotFoundError:
            return {"version": "unknown"}

    @app.get("/metrics", response_class=PlainTextResponse, responses={
        200: {"description": "Prometheus' text exposition format 0.0.4.", "content": {"text/plain": {}}}})
    async def metrics() -> PlainTextResponse:
        return PlainTextResponse(serving.metrics.render(), media_type=CONTENT_TYPE)

    if dev_mode:
        @app.post("/reset_prefix_cache", response_class=Response, responses={
            200: {"description": "The prefix cache is forgotten (no body)."}, **errors(400, 401, 500, 503)})
        async def reset_prefix_cache(
                reset_running_requests: bool = Query(False, description=(
                    "vLLM's: also the blocks of running requests. They are always forgotten here (a running "
                    "request keeps its blocks, which no later prompt is offered), so the reset never fails.")),
                reset_external: bool = Query(False, description=(
                    "vLLM's: also a KV connector's cache; this server has none."))) -> Response:
            serving.check_serving()
            await serving.engine.reset_prefix_cache()
            return Response(status_code=200)

    if engine.profiling:
        @app.post("/start_profile", response_class=Response, responses={
            200: {"description": "Recording (no body)."}, **errors(401, 409, 500)})
        async def start_profile() -> Response:
            await _profile(engine.start_profile)
            return Response(status_code=200)

        @app.post("/stop_profile", response_class=Response, responses={
            200: {"description": "The trace is written to the profiler's folder (no body)."},
            **errors(401, 409, 500)})
        async def stop_profile() -> Response:
            await _profile(engine.stop_profile)
            return Response(status_code=200)

    fixed_paths = frozenset(route.path for route in app.routes if "{" not in route.path)
    app.add_middleware(Gate, api_key=api_key, max_request_bytes=max_request_bytes, metrics=serving.metrics,
                       endpoints=fixed_paths)
    app.add_middleware(CORSMiddleware, **{**DEFAULT_CORS, **(cors or {})})
    return app
