"""The OpenAI-compatible HTTP front end over ``AsyncLLM`` (vLLM's shape).

``build_app(engine, served_model_name, api_key, max_request_bytes)`` returns a FastAPI app with
``POST /v1/completions``, ``POST /v1/chat/completions`` (both with SSE streaming), ``GET /v1/models``,
``GET /health`` and ``GET /metrics``.

- Every error has OpenAI's shape ``{"error": {"message", "type", "param", "code"}}``; a bad field is a
  400 naming it (FastAPI's own 422 is turned into that 400), an unknown model a 404.
- Each prompt of a request is one engine request (one choice). A client that disconnects, streaming
  or not, aborts its engine requests, which frees their KV blocks.
- ``api_key`` guards ``/v1/*`` with bearer auth (401); bodies over ``max_request_bytes`` get 413.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import hmac
import json
import logging
import math
import re
import time
import uuid
from typing import Any, AsyncIterator, Awaitable, Callable

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from vtcore.errors import EngineDeadError, NotSupportedError
from vtcore.outputs import PositionLogprobs, RequestOutput
from vtcore.sampling_params import RequestOutputKind, SamplingParams
from vtcore.server.metrics import CONTENT_TYPE, ServerMetrics
from vtcore.server.protocol import UNSUPPORTED_EXTENSIONS, ChatCompletionRequest, CompletionRequest, _Sampling

log = logging.getLogger("vtcore.server")

#: The most alternatives per position: OpenAI's limits (completions 5, chat 20).
MAX_COMPLETION_LOGPROBS = 5
MAX_CHAT_TOP_LOGPROBS = 20
#: A body over the limit is still read (and dropped) up to this much more, so that the client, which
#: writes its whole body before it reads, sees the 413 instead of a reset connection.
DRAIN_BYTES = 8 << 20
ENDPOINTS = ("/v1/completions", "/v1/chat/completions", "/v1/models", "/health", "/metrics", "/version")

Scope = dict[str, Any]
Receive = Callable[[], Awaitable[dict[str, Any]]]
Send = Callable[[dict[str, Any]], Awaitable[None]]


# ---------------------------------------------------------------------------------------------- errors
class APIError(Exception):
    """An error answered in OpenAI's shape."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 type: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.type = type or ("invalid_request_error" if status < 500 else "server_error")

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self, headers: dict[str, str] | None = None) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=headers)


_PARAM = re.compile(r"SamplingParams\.(\w+)=")
#: apply_chat_template's own arguments: a request may not set them through chat_template_kwargs (a
#: custom template would get round the refusal of the top-level field)
_RESERVED_TEMPLATE_KWARGS = {"chat_template", "conversation", "tokenize", "add_generation_prompt",
                             "continue_final_message", "tools", "documents", "return_dict", "tokenizer_kwargs"}


def to_api_error(exc: BaseException, renames: dict[str, str] | None = None) -> APIError:
    """Map an engine or validation exception to an APIError (400 for a bad request, else 500)."""
    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, EngineDeadError):
        return APIError(500, str(exc), code="engine_dead")
    renames = renames or {}

    def field(msg: str) -> tuple[str, str | None]:
        """(message, request field): SamplingParams' name for a value becomes the field the client sent."""
        m = _PARAM.search(msg)
        if not m:
            return msg, None
        param = m.group(1)
        sent = renames.get(param, param)
        return msg.replace(f"SamplingParams.{param}=", f"{sent}=") if sent != param else msg, sent

    if isinstance(exc, NotSupportedError):
        msg, param = field(str(exc))
        return APIError(400, msg, param, "unsupported")
    if isinstance(exc, (ValueError, TypeError)):
        msg, param = field(str(exc))
        return APIError(400, msg, param)
    log.exception("vtcore server: unexpected error", exc_info=exc)
    return APIError(500, f"internal error: {type(exc).__name__}: {exc}")


def _error_bytes(err: APIError) -> bytes:
    return json.dumps(err.body()).encode()


async def _send_error(send: Send, err: APIError, extra_headers: list[tuple[bytes, bytes]] = ()) -> None:
    body = _error_bytes(err)
    await send({"type": "http.response.start", "status": err.status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                            *extra_headers]})
    await send({"type": "http.response.body", "body": body, "more_body": False})


# ------------------------------------------------------------------------------------------ middleware
class Gate:
    """Pure ASGI middleware: bearer auth on /v1/*, the request-size limit (413), HTTP status counting."""

    def __init__(self, app: Any, api_key: str | None, max_request_bytes: int, metrics: ServerMetrics) -> None:
        self.app = app
        self.api_key = api_key.encode() if api_key else None
        self.max_bytes = max_request_bytes
        self.metrics = metrics

    def _authorized(self, headers: dict[bytes, bytes]) -> bool:
        auth = headers.get(b"authorization", b"")
        scheme, _, token = auth.partition(b" ")
        return scheme.lower() == b"bearer" and hmac.compare_digest(token.strip(), self.api_key)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path = scope.get("path", "")
        status = [0]

        async def counted_send(message: dict[str, Any]) -> None:
            if message["type"] == "http.response.start":
                status[0] = message["status"]
            await send(message)

        try:
            await self._handle(scope, receive, counted_send)
        finally:
            self.metrics.http(path if path in ENDPOINTS else "other", status[0] or 499)

    async def _handle(self, scope: Scope, receive: Receive, send: Send) -> None:
        headers = dict(scope.get("headers") or [])
        if self.api_key is not None and scope.get("path", "").startswith("/v1") and scope.get("method") != "OPTIONS":
            if not self._authorized(headers):
                await _send_error(send, APIError(401, "invalid or missing API key: send the header "
                                                      "'Authorization: Bearer <key>'", code="invalid_api_key"),
                                  [(b"www-authenticate", b"Bearer")])
                return
        if scope.get("method") in ("GET", "HEAD", "OPTIONS", "DELETE"):
            await self.app(scope, receive, send)
            return
        declared = headers.get(b"content-length")
        if declared is not None:
            if not declared.strip().isdigit():
                await _send_error(send, APIError(400, f"Content-Length {declared!r}: expected a number of bytes"))
                return
            if int(declared) > self.max_bytes + DRAIN_BYTES:  # too big even to drain: answer and close
                await _send_error(send, self._too_large(int(declared)))
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
            await _send_error(send, self._too_large(total))
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


# --------------------------------------------------------------------------------------- streaming
async def _wait_disconnect(receive: Receive) -> None:
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return


class EventStream(Response):
    """An SSE response over an async iterator of ``data:`` events.

    Headers go out with the first event, so an error raised before it is a plain JSON error response;
    a later one becomes an ``error`` event before ``[DONE]``. A client disconnect cancels the
    iterator (and so aborts its engine requests).
    """

    media_type = "text/event-stream"

    def __init__(self, events: AsyncIterator[str]) -> None:  # noqa: D107 - no body of its own
        self.events = events
        self.status_code = 200
        self.background = None
        self.raw_headers = [(b"content-type", b"text/event-stream; charset=utf-8"), (b"cache-control", b"no-cache"),
                            (b"x-accel-buffering", b"no")]

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        pump = asyncio.create_task(self._pump(send))
        watch = asyncio.create_task(_wait_disconnect(receive))
        try:
            await asyncio.wait({pump, watch}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in (pump, watch):
                task.cancel()
            await asyncio.gather(pump, watch, return_exceptions=True)
            with contextlib.suppress(Exception):
                await self.events.aclose()  # type: ignore[attr-defined]
        if pump.done() and not pump.cancelled() and pump.exception() is not None:
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
            await _send_error(send, to_api_error(exc))
            return
        await send({"type": "http.response.start", "status": 200, "headers": self.raw_headers})
        if first is not None:
            await send({"type": "http.response.body", "body": first.encode(), "more_body": True})
            try:
                async for event in it:
                    await send({"type": "http.response.body", "body": event.encode(), "more_body": True})
            except Exception as exc:  # noqa: BLE001 - after the headers: an error event
                err = _sse(to_api_error(exc).body()) + "data: [DONE]\n\n"
                await send({"type": "http.response.body", "body": err.encode(), "more_body": True})
        await send({"type": "http.response.body", "body": b"", "more_body": False})


def _sse(obj: Any) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False, separators=(',', ':'))}\n\n"


# --------------------------------------------------------------------------------------- generation
class _Delta:
    """What one engine output adds to a choice."""

    __slots__ = ("text", "token_ids", "logprobs", "finished", "finish_reason", "stop_reason")

    def __init__(self, text: str, token_ids: list[int], logprobs: list[PositionLogprobs], finished: bool,
                 finish_reason: str | None, stop_reason: int | str | None) -> None:
        self.text, self.token_ids, self.logprobs = text, token_ids, logprobs
        self.finished, self.finish_reason, self.stop_reason = finished, finish_reason, stop_reason


class _Sub:
    """One prompt of a request, or one of its ``n`` samples (``sample``): one engine request, one choice."""

    def __init__(self, index: int, rid: str, text: str, ids: list[int], params: SamplingParams,
                 sample: int = 0) -> None:
        self.index = index
        self.sample = sample
        self.rid = rid
        self.prompt_text = text
        self.prompt_ids = ids
        self.params = params
        self.text = ""
        self.token_ids: list[int] = []
        self.logprobs: list[PositionLogprobs] = []
        self.prompt_logprobs: list[PositionLogprobs | None] | None = None
        self.finish_reason: str | None = None
        self.stop_reason: int | str | None = None
        self.arrival = time.monotonic()
        self.first_token: float | None = None
        self.done = False

    def update(self, out: RequestOutput) -> _Delta:
        co = out.outputs[0]
        text, token_ids, logprobs = co.text, list(co.token_ids), list(co.logprobs or [])
        finish_reason, stop_reason = co.finish_reason, co.stop_reason
        self.text += text
        if token_ids and self.first_token is None:
            self.first_token = time.monotonic()
        self.token_ids += token_ids
        self.logprobs += logprobs
        if out.prompt_logprobs is not None:
            self.prompt_logprobs = out.prompt_logprobs
        if out.finished:
            self.finish_reason, self.stop_reason = finish_reason, stop_reason
            self.done = True
        return _Delta(text, token_ids, logprobs, out.finished, finish_reason if out.finished else None,
                      stop_reason if out.finished else None)

    @property
    def prompt_logprobs_ready(self) -> bool:
        return self.params.prompt_logprobs is None or self.done or (
            self.prompt_logprobs is not None and len(self.prompt_logprobs) >= len(self.prompt_ids))


def _finite(x: float) -> float:
    return x if math.isfinite(x) else -9999.0


class OpenAIServer:
    """The request handlers; ``build_app`` routes to them."""

    def __init__(self, engine: Any, served_model_name: str) -> None:
        self.engine = engine
        self.core = engine.engine
        self.name = served_model_name
        self.created = int(time.time())
        self.metrics = ServerMetrics(served_model_name, engine)
        self.tokenizer = self.core.tokenizer
        self.live: dict[str, _Sub] = {}  # engine requests in flight, by request id
        self.draining = False  # shutting down: new requests get 503
        # Requests are validated and tokenized on these threads, off the event loop: a large prompt
        # takes seconds and would stall every stream. Several, so one large prompt holds up no other
        # request (fast tokenizers encode concurrently; the engine thread decodes meanwhile already).
        self.preparer = concurrent.futures.ThreadPoolExecutor(4, thread_name_prefix="vtcore-prepare")

    async def prepare(self, fn: Any, body: Any) -> tuple[list[_Sub], dict[str, str]]:
        return await asyncio.get_running_loop().run_in_executor(self.preparer, fn, body)

    async def abort_all(self) -> int:
        """Abort every engine request in flight: streams end with finish_reason "abort" and [DONE],
        non-streaming requests answer with what they have. Returns how many were aborted."""
        ids = list(self.live)
        for rid in ids:
            await self.engine.abort(rid)
        return len(ids)

    # ------------------------------------------------------------------ checks
    def check_model(self, model: str | None) -> None:
        if model is not None and model != self.name:
            raise APIError(404, f"The model {model!r} does not exist; this server serves {self.name!r} "
                                "(see GET /v1/models)", "model", "model_not_found")

    @staticmethod
    def check_unsupported(body: _Sampling) -> None:
        if body.n is not None and body.n < 1:
            raise APIError(400, f"n={body.n}: expected a positive integer (choices per prompt)", "n")
        if body.best_of not in (None, 1):
            raise APIError(400, f"best_of={body.best_of}: only best_of=1 is supported", "best_of", "unsupported")
        if body.use_beam_search:
            raise APIError(400, "use_beam_search=true: beam search is not supported", "use_beam_search",
                           "unsupported")
        if body.response_format is not None and body.response_format.type != "text":
            raise APIError(400, f"response_format type {body.response_format.type!r}: only 'text' is supported",
                           "response_format", "unsupported")
        chat_echo = {"echo": False} if isinstance(body, ChatCompletionRequest) else {}
        for field, harmless in {**UNSUPPORTED_EXTENSIONS, **chat_echo}.items():
            value = (body.model_extra or {}).get(field, harmless)
            if value is not None and value != harmless:
                raise APIError(400, f"{field}={value!r}: this vLLM extension is not supported here; leave it out",
                               field, "unsupported")

    def sampling_kwargs(self, body: _Sampling) -> dict[str, Any]:
        # the checkpoint's generation_config.json sampling values stand in for fields the client left out
        defaults = {k: v for k, v in self.core.default_sampling().items() if k != "max_tokens"}
        kw: dict[str, Any] = {**defaults, "output_kind": RequestOutputKind.DELTA}
        for name in ("temperature", "top_p", "presence_penalty", "frequency_penalty", "seed", "top_k", "min_p",
                     "repetition_penalty", "min_tokens", "stop", "stop_token_ids"):
            value = getattr(body, name)
            if value is not None:
                kw[name] = value
        kw["ignore_eos"] = bool(body.ignore_eos)
        kw["include_stop_str_in_output"] = bool(body.include_stop_str_in_output)
        kw["skip_special_tokens"] = body.skip_special_tokens is not False
        if body.logit_bias:
            bias: dict[int, float] = {}
            for key, value in body.logit_bias.items():
                try:
                    tid = int(key)
                except ValueError:
                    raise APIError(400, f"logit_bias key {key!r}: expected a token id (a string of an integer)",
                                   "logit_bias") from None
                bias[tid] = max(-100.0, min(100.0, float(value)))
            kw["logit_bias"] = bias
        return kw

    def make_params(self, kw: dict[str, Any], renames: dict[str, str]) -> SamplingParams:
        try:
            params = SamplingParams(**kw)
            params.check_vocab(self.core.vocab_size)
        except (ValueError, TypeError, NotImplementedError) as exc:
            raise to_api_error(exc, renames) from None
        return params

    def check_length(self, n_prompt: int, max_tokens: int | None, field: str, tokens_field: str) -> int | None:
        """Reject a prompt (and max_tokens) that cannot fit; return the max_tokens to ask the engine for
        (when the client gave none and the KV pool holds less than the context, what the pool holds)."""
        limit = self.core.max_model_len
        if n_prompt == 0:
            raise APIError(400, f"{field}: the prompt is empty; expected at least one token", field)
        if n_prompt >= limit:
            raise APIError(400, f"This model's maximum context length is {limit} tokens, but the {field} has "
                                f"{n_prompt} tokens, which leaves no room to generate; shorten the {field}",
                           field, "context_length_exceeded")
        if max_tokens is not None and n_prompt + max_tokens > limit:
            raise APIError(400, f"This model's maximum context length is {limit} tokens. However, you requested "
                                f"{n_prompt + max_tokens} tokens ({n_prompt} in the {field}, {max_tokens} in "
                                f"the completion). Reduce the length of the {field} or {tokens_field}.",
                           tokens_field, "context_length_exceeded")
        pool = self.core.pool
        capacity = pool.num_blocks * pool.block_size
        if max_tokens is None and capacity < limit and n_prompt < capacity:
            return capacity - n_prompt
        longest = n_prompt + (limit - n_prompt if max_tokens is None else max_tokens)
        if pool.blocks_needed(longest) > pool.num_blocks:
            raise APIError(400, f"up to {longest} tokens ({n_prompt} in the {field}) need "
                                f"{pool.blocks_needed(longest)} KV blocks, but the pool holds {pool.num_blocks}; "
                                f"lower {tokens_field}", tokens_field, "context_length_exceeded")
        return max_tokens

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=False) if self.tokenizer is not None else ""

    def piece(self, tid: int, lp: Any = None) -> str:
        if lp is not None and lp.decoded_token is not None:
            return lp.decoded_token
        return self.decode([tid])

    # ------------------------------------------------------------------ running
    async def merged(self, subs: list[_Sub]) -> AsyncIterator[tuple[_Sub, _Delta]]:
        """Run every sub-request at once; yield (sub, delta output) as they come. Leaving aborts them."""
        queue: asyncio.Queue = asyncio.Queue()

        async def pump(sub: _Sub) -> None:
            failed = False
            self.live[sub.rid] = sub
            try:
                async for out in self.engine.generate({"prompt": sub.prompt_text, "prompt_token_ids": sub.prompt_ids},
                                                      sub.params, sub.rid):
                    queue.put_nowait((sub, sub.update(out)))
            except Exception as exc:  # noqa: BLE001 - handed to the caller
                failed = True
                queue.put_nowait((sub, exc))
            finally:
                self.live.pop(sub.rid, None)
                if not failed:
                    self.metrics.finished(sub.finish_reason or "abort", len(sub.prompt_ids), len(sub.token_ids),
                                          sub.arrival, sub.first_token, time.monotonic())
                queue.put_nowait((sub, None))

        tasks = [asyncio.create_task(pump(s)) for s in subs]
        try:
            running = len(subs)
            while running:
                sub, item = await queue.get()
                if item is None:
                    running -= 1
                elif isinstance(item, BaseException):
                    raise item
                else:
                    yield sub, item
        finally:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    async def run_to_end(self, subs: list[_Sub], request: Request, renames: dict[str, str]) -> bool:
        """Run a non-streaming request; False if the client went away first (its requests are aborted)."""
        async def run() -> None:
            async with contextlib.aclosing(self.merged(subs)) as it:
                async for _ in it:
                    pass

        work = asyncio.create_task(run())
        watch = asyncio.create_task(_wait_disconnect(request.receive))
        try:
            await asyncio.wait({work, watch}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for t in (work, watch):
                t.cancel()
            await asyncio.gather(work, watch, return_exceptions=True)
        if work.cancelled():
            return False
        if work.exception() is not None:
            raise to_api_error(work.exception(), renames)
        return True

    @staticmethod
    def samples(params: SamplingParams, n: int | None) -> list[SamplingParams]:
        """A prompt's ``n`` choices as single requests, as the engine runs ``n > 1`` (vLLM's parallel
        sampling): sample ``j`` seeded ``seed + j`` when seeded."""
        return [params.sample(j) for j in range(n or 1)]

    @staticmethod
    def usage(subs: list[_Sub]) -> dict[str, int]:
        p = sum(len(s.prompt_ids) for s in subs if s.sample == 0)  # a prompt counts once, whatever its n
        c = sum(len(s.token_ids) for s in subs)
        return {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c}

    # ------------------------------------------------------------------ completions
    def completion_logprobs(self, entries: list[tuple[int, PositionLogprobs | None]],
                            offset: int) -> tuple[dict[str, Any], int]:
        tokens, token_lps, tops, offsets = [], [], [], []
        for tid, pos in entries:
            chosen = pos.get(tid) if pos else None
            tok = self.piece(tid, chosen)
            tokens.append(tok)
            token_lps.append(None if chosen is None else _finite(chosen.logprob))
            tops.append(None if pos is None else {self.piece(t, lp): _finite(lp.logprob) for t, lp in pos.items()})
            offsets.append(offset)
            offset += len(tok)
        return {"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": tops, "text_offset": offsets}, offset

    def _prompt_entries(self, sub: _Sub) -> list[tuple[int, PositionLogprobs | None]]:
        plp = sub.prompt_logprobs or []
        return [(t, plp[i] if i < len(plp) else None) for i, t in enumerate(sub.prompt_ids)]

    def check_serving(self) -> None:
        if self.draining:
            raise APIError(503, "the server is shutting down", code="shutting_down")

    def prepare_completion(self, body: CompletionRequest) -> tuple[list[_Sub], dict[str, str]]:
        self.check_serving()
        self.check_model(body.model)
        self.check_unsupported(body)
        if body.suffix:
            raise APIError(400, "suffix: insertion (a non-empty suffix) is not supported", "suffix", "unsupported")
        if body.logprobs is not None and not 0 <= body.logprobs <= MAX_COMPLETION_LOGPROBS:
            raise APIError(400, f"logprobs={body.logprobs}: expected an integer in [0, {MAX_COMPLETION_LOGPROBS}]",
                           "logprobs")
        prompt = body.prompt
        if isinstance(prompt, str) or (prompt and all(isinstance(t, int) for t in prompt)):
            prompts: list[Any] = [prompt]
        elif not prompt:
            raise APIError(400, "prompt: expected a non-empty string, list of token ids, or list of either",
                           "prompt")
        else:
            prompts = list(prompt)
        kw = self.sampling_kwargs(body)
        kw["max_tokens"] = body.max_tokens
        if body.logprobs is not None:
            kw["logprobs"] = body.logprobs
            if body.echo:
                kw["prompt_logprobs"] = body.logprobs
        renames = {"prompt_logprobs": "logprobs"}
        self.make_params(kw, renames)  # every value checked as the client sent it
        rid = f"cmpl-{uuid.uuid4().hex}"
        subs = []
        for i, p in enumerate(prompts):
            try:
                text, ids = self.core.tokenize(p if isinstance(p, str) else {"prompt_token_ids": list(p)})
            except ValueError as exc:
                raise APIError(400, f"prompt: {exc}", "prompt") from None
            max_tokens = self.check_length(len(ids), body.max_tokens, "prompt", "max_tokens")
            params = self.make_params(kw if max_tokens == body.max_tokens else {**kw, "max_tokens": max_tokens},
                                      renames)
            n = body.n or 1
            subs += [_Sub(i * n + j, f"{rid}-{i * n + j}", text if text is not None else self.decode(ids), ids, p, j)
                     for j, p in enumerate(self.samples(params, n))]
        return subs, renames

    async def completions(self, body: CompletionRequest, request: Request) -> Any:
        subs, renames = await self.prepare(self.prepare_completion, body)
        rid, created = subs[0].rid.rsplit("-", 1)[0], int(time.time())
        if body.stream:
            return EventStream(self.completion_events(body, subs, rid, created))
        if not await self.run_to_end(subs, request, renames):
            return Response(status_code=499)
        choices = []
        for s in subs:
            text, logprobs = s.text, None
            entries = [(t, s.logprobs[i] if i < len(s.logprobs) else None) for i, t in enumerate(s.token_ids)]
            if body.echo:
                text = s.prompt_text + text
                entries = self._prompt_entries(s) + entries
            if body.logprobs is not None:
                logprobs, _ = self.completion_logprobs(entries, 0)
            choices.append({"index": s.index, "text": text, "logprobs": logprobs, "finish_reason": s.finish_reason,
                            "stop_reason": s.stop_reason})
        return JSONResponse({"id": rid, "object": "text_completion", "created": created, "model": self.name,
                             "choices": choices, "usage": self.usage(subs)})

    async def completion_events(self, body: CompletionRequest, subs: list[_Sub], rid: str,
                                created: int) -> AsyncIterator[str]:
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        echo_pending = {s.index: bool(body.echo) for s in subs}
        offsets = {s.index: 0 for s in subs}
        async with contextlib.aclosing(self.merged(subs)) as it:
            async for sub, out in it:
                text = out.text
                entries = [(t, lp) for t, lp in zip(out.token_ids, out.logprobs or [None] * len(out.token_ids))]
                if echo_pending[sub.index]:
                    if not sub.prompt_logprobs_ready:
                        continue  # a prefill chunk: the prompt's logprobs are not complete yet
                    echo_pending[sub.index] = False
                    text = sub.prompt_text + text
                    entries = self._prompt_entries(sub) + entries
                if not text and not entries and not out.finished:
                    continue
                logprobs = None
                if body.logprobs is not None:
                    logprobs, offsets[sub.index] = self.completion_logprobs(entries, offsets[sub.index])
                chunk: dict[str, Any] = {
                    "id": rid, "object": "text_completion", "created": created, "model": self.name,
                    "choices": [{"index": sub.index, "text": text, "logprobs": logprobs,
                                 "finish_reason": out.finish_reason, "stop_reason": out.stop_reason}]}
                if include_usage:
                    chunk["usage"] = None
                yield _sse(chunk)
        if include_usage:
            yield _sse({"id": rid, "object": "text_completion", "created": created, "model": self.name,
                        "choices": [], "usage": self.usage(subs)})
        yield "data: [DONE]\n\n"

    # ------------------------------------------------------------------ chat
    def prepare_chat(self, body: ChatCompletionRequest) -> tuple[list[_Sub], dict[str, str]]:
        self.check_serving()
        self.check_model(body.model)
        self.check_unsupported(body)
        for field in ("tools", "functions"):
            if getattr(body, field):
                raise APIError(400, f"{field}: tool and function calling are not supported", field, "unsupported")
        for field in ("tool_choice", "function_call"):
            if getattr(body, field) not in (None, "none"):
                raise APIError(400, f"{field}: tool and function calling are not supported", field, "unsupported")
        if body.top_logprobs is not None:
            if not body.logprobs:
                raise APIError(400, "top_logprobs: requires logprobs=true", "top_logprobs")
            if not 0 <= body.top_logprobs <= MAX_CHAT_TOP_LOGPROBS:
                raise APIError(400, f"top_logprobs={body.top_logprobs}: expected an integer in "
                                    f"[0, {MAX_CHAT_TOP_LOGPROBS}]", "top_logprobs")
        messages = []
        for i, m in enumerate(body.messages):
            content = m.content
            if isinstance(content, list):
                parts = []
                for part in content:
                    if part.type != "text" or part.text is None:
                        raise APIError(400, f"messages[{i}].content: part of type {part.type!r}; only text parts "
                                            "are supported", "messages", "unsupported")
                    parts.append(part.text)
                content = "\n".join(parts)
            msg = {"role": m.role, "content": content or ""}
            if m.name is not None:
                msg["name"] = m.name
            messages.append(msg)
        reserved = sorted(set(body.chat_template_kwargs or {}) & _RESERVED_TEMPLATE_KWARGS)
        if reserved:
            raise APIError(400, f"chat_template_kwargs: {reserved[0]!r} is not a template variable the server lets a "
                                "request set", "chat_template_kwargs", "unsupported")
        try:
            prompt = self.core.chat_prompt(messages, **(body.chat_template_kwargs or {}))
        except Exception as exc:  # noqa: BLE001 - the template rejected the conversation
            raise APIError(400, f"messages: the chat template failed: {type(exc).__name__}: {exc}",
                           "messages") from None
        max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
        tokens_field = "max_completion_tokens" if body.max_completion_tokens is not None else "max_tokens"
        ids = prompt["prompt_token_ids"]
        kw = self.sampling_kwargs(body)
        kw["max_tokens"] = self.check_length(len(ids), max_tokens, "messages", tokens_field)
        if body.logprobs:
            kw["logprobs"] = body.top_logprobs or 0
        renames = {"max_tokens": tokens_field, "logprobs": "top_logprobs"}
        rid = f"chatcmpl-{uuid.uuid4().hex}"
        return [_Sub(j, f"{rid}-{j}", prompt["prompt"], ids, p, j)
                for j, p in enumerate(self.samples(self.make_params(kw, renames), body.n))], renames

    def chat_logprobs(self, token_ids: list[int], entries: list[PositionLogprobs], k: int) -> dict[str, Any]:
        content = []
        for tid, pos in zip(token_ids, entries):
            chosen = pos.get(tid)
            tok = self.piece(tid, chosen)
            top = sorted((lp.rank, t, lp) for t, lp in pos.items() if lp.rank is not None and lp.rank <= k)[:k]
            content.append({"token": tok, "logprob": _finite(chosen.logprob) if chosen else -9999.0,
                            "bytes": list(tok.encode()),
                            "top_logprobs": [{"token": self.piece(t, lp), "logprob": _finite(lp.logprob),
                                              "bytes": list(self.piece(t, lp).encode())} for _, t, lp in top]})
        return {"content": content}

    async def chat(self, body: ChatCompletionRequest, request: Request) -> Any:
        subs, renames = await self.prepare(self.prepare_chat, body)
        rid, created = subs[0].rid.rsplit("-", 1)[0], int(time.time())
        if body.stream:
            return EventStream(self.chat_events(body, subs, rid, created))
        if not await self.run_to_end(subs, request, renames):
            return Response(status_code=499)
        choices = [{"index": s.index, "message": {"role": "assistant", "content": s.text},
                    "logprobs": self.chat_logprobs(s.token_ids, s.logprobs, body.top_logprobs or 0)
                    if body.logprobs else None, "finish_reason": s.finish_reason, "stop_reason": s.stop_reason}
                   for s in subs]
        return JSONResponse({"id": rid, "object": "chat.completion", "created": created, "model": self.name,
                             "choices": choices, "usage": self.usage(subs)})

    async def chat_events(self, body: ChatCompletionRequest, subs: list[_Sub], rid: str,
                          created: int) -> AsyncIterator[str]:
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        head = {"id": rid, "object": "chat.completion.chunk", "created": created, "model": self.name}
        extra = {"usage": None} if include_usage else {}
        role_sent: set[int] = set()
        async with contextlib.aclosing(self.merged(subs)) as it:
            async for sub, out in it:
                if sub.index not in role_sent:  # each choice opens with the assistant role
                    role_sent.add(sub.index)
                    yield _sse({**head, "choices": [{"index": sub.index, "delta": {"role": "assistant",
                                                                                   "content": ""},
                                                     "logprobs": None, "finish_reason": None}], **extra})
                if not out.text and not out.token_ids and not out.finished:
                    continue
                logprobs = None
                if body.logprobs and out.token_ids:
                    logprobs = self.chat_logprobs(out.token_ids, out.logprobs, body.top_logprobs or 0)
                delta = {"content": out.text} if out.text or not out.finished else {}
                yield _sse({**head, "choices": [{"index": sub.index, "delta": delta, "logprobs": logprobs,
                                                 "finish_reason": out.finish_reason,
                                                 "stop_reason": out.stop_reason}],
                            **extra})
        if include_usage:
            yield _sse({**head, "choices": [], "usage": self.usage(subs)})
        yield "data: [DONE]\n\n"

    # ------------------------------------------------------------------ the rest
    def models(self) -> dict[str, Any]:
        return {"object": "list", "data": [self.model_card()]}

    def model_card(self) -> dict[str, Any]:
        return {"id": self.name, "object": "model", "created": self.created, "owned_by": "vtcore",
                "root": self.core.config.model, "parent": None, "max_model_len": self.core.max_model_len}

    def healthy(self) -> bool:
        return (not self.draining and getattr(self.engine, "dead", None) is None
                and not getattr(self.engine, "_stopping", False))


# ------------------------------------------------------------------------------------------- the app
def _validation_error(exc: RequestValidationError, content_type: str) -> APIError:
    errors = exc.errors()
    if not errors:
        return APIError(400, "invalid request body")
    first = errors[0]
    loc = [p for p in first.get("loc", ()) if p != "body"]
    if first.get("type") == "json_invalid":
        return APIError(400, f"the request body is not valid JSON: {first.get('msg')}")
    if not loc:
        hint = "" if "json" in content_type else f" sent with Content-Type: application/json (got {content_type!r})"
        return APIError(400, f"the request body: {first.get('msg')}; expected a JSON object{hint}")
    param = str(loc[0])
    where = param + "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in loc[1:]
                            if isinstance(p, int) or not re.search(r"[\[|]|^(str|int|float|bool|list)$", str(p)))
    if param == "prompt":
        msg = "prompt: expected a string, a list of token ids, or a list of strings or of token-id lists"
    else:
        msg = f"{where}: {first.get('msg')} (got {first.get('input')!r:.80})"
    return APIError(400, msg, param)


def build_app(engine: Any, served_model_name: str, api_key: str | None = None,
              max_request_bytes: int = 8 << 20) -> FastAPI:
    """The OpenAI-compatible app over ``engine`` (an ``AsyncLLM``); see the module docstring."""
    if not isinstance(max_request_bytes, int) or max_request_bytes <= 0:
        raise ValueError(f"max_request_bytes={max_request_bytes!r}: expected a positive number of bytes")
    server = OpenAIServer(engine, served_model_name)
    app = FastAPI(title="vtcore", docs_url=None, redoc_url=None, openapi_url=None)
    app.state.server = server

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError) -> JSONResponse:
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        return _validation_error(exc, request.headers.get("content-type", "")).response()

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code)
        return APIError(exc.status_code, f"{request.method} {request.url.path}: {exc.detail}", code=code).response(
            dict(exc.headers or {}))

    @app.exception_handler(Exception)
    async def _crash(request: Request, exc: Exception) -> JSONResponse:
        return to_api_error(exc).response()

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request) -> Any:
        return await server.completions(body, request)

    @app.post("/v1/chat/completions")
    async def chat(body: ChatCompletionRequest, request: Request) -> Any:
        return await server.chat(body, request)

    @app.get("/v1/models")
    async def models() -> Any:
        return server.models()

    @app.get("/v1/models/{model:path}")
    async def model(model: str) -> Any:
        server.check_model(model)
        return server.model_card()

    @app.get("/health")
    async def health() -> Any:
        if not server.healthy():
            raise APIError(503, "the server is shutting down or its engine is not running", code="unavailable")
        return {"status": "ok"}

    @app.get("/version")
    async def version() -> Any:
        from importlib.metadata import PackageNotFoundError, version as dist_version

        try:
            return {"version": dist_version("vtcore")}
        except PackageNotFoundError:
            return {"version": "unknown"}

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(server.metrics.render(), media_type=CONTENT_TYPE)

    app.add_middleware(Gate, api_key=api_key, max_request_bytes=max_request_bytes, metrics=server.metrics)
    return app
