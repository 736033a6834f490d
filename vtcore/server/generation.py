"""The skeleton that the generation endpoints (completions, chat, responses) share.

A request is prepared off the event loop (the checks every endpoint makes, the endpoint's own,
tokenizing, ``SamplingParams``), then each of its prompts runs as one engine request whose ``n``
samples (the engine's parallel sampling) are that prompt's choices: choice ``prompt * n + sample``.
The answer is one JSON body, or an SSE stream of chunks that the endpoint formats. A client that
goes away, streaming or not, aborts the engine requests, which frees their KV blocks. An endpoint
fills in the hooks: ``check``, ``sampling``, ``prompts``, ``response_choice`` and ``stream``.
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
import uuid
from abc import ABC, abstractmethod
from typing import Any, AsyncIterator, ClassVar, Generic, Protocol, TypeVar

import attrs
from fastapi import Request
from fastapi.responses import JSONResponse, Response

from vtcore.outputs import CompletionOutput, Logprob, PositionLogprobs, RequestMetrics
from vtcore.sampling_params import RequestOutputKind, SamplingParams
from vtcore.server.errors import APIError, to_api_error
from vtcore.server.protocol import GenerationRequest, json_equal
from vtcore.server.serving import Serving, request_log
from vtcore.server.sse import DONE, EventStream, sse, unless_disconnected
from vtcore.server.structured import RESPONSE_FORMATS, structured_outputs

log = logging.getLogger("vtcore.server")

Body = TypeVar("Body", bound=GenerationRequest)
#: the logprob shown for -inf (JSON has no infinities; OpenAI shows -9999.0)
NO_LOGPROB = -9999.0


def finite(logprob: float) -> float:
    return logprob if math.isfinite(logprob) else NO_LOGPROB


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> dict[str, Any]:
    """OpenAI's usage object; ``cached_tokens``: prompt tokens whose KV came from the prefix cache."""
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached_tokens}}


@attrs.frozen
class Delta:
    """What one engine output adds to a choice; ``num_tokens``: the choice's tokens with it."""

    text: str
    token_ids: list[int]
    logprobs: list[PositionLogprobs]
    finish_reason: str | None
    stop_reason: int | str | None
    num_tokens: int


class EnginePrompt:
    """One prompt of a request: one engine request, whose samples are ``choices``."""

    def __init__(self, rid: str, text: str | None, ids: list[int], params: SamplingParams, first_index: int,
                 cache_salt: str | None = None, priority: int = 0) -> None:
        self.rid = rid
        self.priority = priority
        self.text = text
        self.ids = ids
        self.cache_salt = cache_salt
        self.params = params
        self.choices = [Choice(first_index + j, self) for j in range(params.n)]
        self.prompt_logprobs: list[PositionLogprobs | None] | None = None
        self.num_cached_tokens = 0
        self.arrival = time.monotonic()
        self.engine_metrics: RequestMetrics | None = None  # the engine's timestamps, from its latest output


class Choice:
    """One choice of the response: what its engine sample has generated so far."""

    def __init__(self, index: int, prompt: EnginePrompt) -> None:
        self.index = index
        self.prompt = prompt
        self.text = ""
        self.token_ids: list[int] = []
        self.logprobs: list[PositionLogprobs] = []
        self.finish_reason: str | None = None
        self.stop_reason: int | str | None = None
        self.first_token: float | None = None
        self.last_token: float | None = None  # (when the latest output with tokens came)
        self.gap: float | None = None  # seconds between the last two outputs with tokens (None before a second)
        self.prompt_counted = False  # (in the server's prompt-token counter: with the choice's first output)
        self.end: float | None = None

    def update(self, out: CompletionOutput) -> Delta:
        """Add one (delta) engine output of this choice's sample."""
        self.text += out.text
        if out.token_ids:
            now = time.monotonic()
            self.first_token = self.first_token or now
            self.gap = None if self.last_token is None else now - self.last_token
            self.last_token = now
        self.token_ids += out.token_ids
        logprobs = list(out.logprobs or [])
        self.logprobs += logprobs
        if out.finish_reason is not None:
            self.finish_reason, self.stop_reason, self.end = out.finish_reason, out.stop_reason, time.monotonic()
        return Delta(out.text, list(out.token_ids), logprobs, out.finish_reason, out.stop_reason, len(self.token_ids))

    @property
    def prompt_logprobs_ready(self) -> bool:
        """Whether the prompt's logprobs (asked for with echo) are all in, or this choice is over."""
        p = self.prompt
        return p.params.prompt_logprobs is None or self.finish_reason is not None or (
            p.prompt_logprobs is not None and len(p.prompt_logprobs) >= len(p.ids))

    def prompt_entries(self) -> list[tuple[int, PositionLogprobs | None]]:
        """(token, its logprobs) of each prompt position (the first has none)."""
        plp = self.prompt.prompt_logprobs or []
        return [(t, plp[i] if i < len(plp) else None) for i, t in enumerate(self.prompt.ids)]


@attrs.frozen
class Job:
    """A prepared request: its id, its prompts and how SamplingParams' field names map to its own."""

    id: str
    created: int
    prompts: list[EnginePrompt]
    renames: dict[str, str]

    @property
    def choices(self) -> list[Choice]:
        return [c for p in self.prompts for c in p.choices]

    def usage(self) -> dict[str, int]:
        """A prompt's tokens count once, whatever its ``n``."""
        return usage(sum(len(p.ids) for p in self.prompts), sum(len(c.token_ids) for c in self.choices),
                     sum(p.num_cached_tokens for p in self.prompts))


@attrs.frozen
class Prompts:
    """What a request generates from: each prompt's (text, or None where only its ids were given and nothing
    shows the text; token ids), the field that holds them, and whether it holds a list of prompts (an error names
    the one at fault: ``prompt[1]``)."""

    items: list[tuple[str | None, list[int]]]
    field: str
    batched: bool = False


class ChoiceStream(Protocol):
    """One streamed response's formatting, with whatever it must remember between chunks."""

    def chunks(self, choice: Choice, delta: Delta) -> list[tuple[dict[str, Any], int]]:
        """The chunk choices ``delta`` makes (none while there is nothing to send), each with the
        choice's completion tokens at that chunk (for ``continuous_usage_stats``)."""


class GenerationEndpoint(ABC, Generic[Body]):
    """``await endpoint(body, request)`` answers one request; subclasses fill in the hooks."""

    id_prefix: ClassVar[str]  # of the response id: "cmpl", "chatcmpl", "resp"
    id_separator: ClassVar[str] = "-"  # between the prefix and the hex ("resp_...": OpenAI's Responses ids)
    object: ClassVar[str]  # the response's "object"
    chunk_object: ClassVar[str]  # a streamed chunk's "object"

    def __init__(self, serving: Serving) -> None:
        self.serving = serving
        self.engine = serving.engine

    # ------------------------------------------------------------------ hooks
    def check(self, body: Body) -> None:
        """Refuse what this endpoint does not serve (APIError)."""

    def light(self, body: Body) -> bool:
        """Whether preparing ``body`` is cheap enough for the event loop: no text to tokenize or render (a
        hop to a preparing thread and back costs more than checking token ids)."""
        return False

    @abstractmethod
    def sampling(self, body: Body) -> tuple[dict[str, Any], dict[str, str]]:
        """This endpoint's SamplingParams fields (``max_tokens`` always), and the request's names
        of SamplingParams fields (``{"max_tokens": "max_completion_tokens"}``) for error messages."""

    @abstractmethod
    def prompts(self, body: Body) -> Prompts:
        """The request's prompts, tokenized (a bad one: APIError naming the field)."""

    @abstractmethod
    def response_choice(self, body: Body, choice: Choice) -> dict[str, Any]:
        """A finished choice as the non-streaming response shows it."""

    @abstractmethod
    def stream(self, body: Body) -> ChoiceStream:
        """The formatting of one streamed response."""

    # ------------------------------------------------------------------ the skeleton
    async def __call__(self, body: Body, request: Request) -> Response:
        job = self.prepare(body) if self.light(body) else await self.serving.off_loop(self.prepare, body)
        if body.stream:
            return EventStream(self.events(body, job))
        if not await self.run_to_end(job, request):
            return Response(status_code=499)
        return JSONResponse({"id": job.id, "object": self.object, "created": job.created,
                             "model": self.serving.model_name(body.model),
                             "choices": [self.response_choice(body, c) for c in job.choices], "usage": job.usage(),
                             **self.response_extra(body, job)})

    def response_extra(self, body: Body, job: Job) -> dict[str, Any]:
        """Fields of a whole (not streamed) response beside its choices."""
        return {}

    def first_chunk_extra(self, body: Body, job: Job) -> dict[str, Any]:
        """Fields beside the choices of each choice's first streamed chunk (vLLM's chat puts the prompt's
        token ids in every choice's role chunk)."""
        return {}

    def prepare(self, body: Body) -> Job:
        """Check, tokenize and turn into SamplingParams (on a preparing thread unless ``light``)."""
        self.serving.check_serving()
        self.serving.check_model(body.model)
        self.check_unsupported(body)
        self.check(body)
        endpoint_kw, renames = self.sampling(body)
        kw = {**self.sampling_kwargs(body), **endpoint_kw, "n": body.n or 1}
        checked = self.make_params(kw, renames)  # every value checked as the client sent it
        prompts = self.prompts(body)
        tokens_field = renames.get("max_tokens", "max_tokens")
        asked = kw["max_tokens"] if kw["max_tokens"] is not None else self.serving.default_max_tokens
        wanted = min((v for v in (asked, self.serving.max_tokens_cap) if v is not None), default=None)
        job_id = f"{self.id_prefix}{self.id_separator}{uuid.uuid4().hex}"
        engine_prompts = []
        for i, (text, ids) in enumerate(prompts.items):
            kept = checked.truncated(ids, self.serving.limits.max_model_len)
            if len(kept) < len(ids):  # (before the length check: the engine runs the kept tokens)
                text, ids = (None if text is None else self.serving.decode(kept)), kept
            where = f"{prompts.field}[{i}]" if prompts.batched else prompts.field
            max_tokens = self.check_length(len(ids), wanted, where, tokens_field, prompts.field)
            params = checked if max_tokens == kw["max_tokens"] else self.make_params({**kw, "max_tokens": max_tokens},
                                                                                      renames)
            engine_prompts.append(EnginePrompt(f"{job_id}-{i}", text, ids, params, i * params.n, body.cache_salt,
                                               body.priority))
        return Job(job_id, int(time.time()), engine_prompts, renames)

    async def events(self, body: Body, job: Job) -> AsyncIterator[bytes]:
        """The SSE events of a streamed response: chunks, the usage chunk if asked for, [DONE]."""
        options = body.stream_options
        force = self.serving.force_include_usage  # (vLLM's: usage in every chunk, and at the end)
        include_usage = force or bool(options and options.include_usage)
        continuous = force or (include_usage and bool(options.continuous_usage_stats))
        head = {"id": job.id, "object": self.chunk_object, "created": job.created,
                "model": self.serving.model_name(body.model)}
        stream = self.stream(body)
        extra = self.first_chunk_extra(body, job)
        started: set[int] = set()  # choices with a chunk sent
        async with contextlib.aclosing(self.merged(job)) as it:
            async for choice, delta in it:
                for entry, completion_tokens in stream.chunks(choice, delta):
                    chunk = {**head, "choices": [entry]}
                    if choice.index not in started:
                        started.add(choice.index)
                        chunk.update(extra)
                    if include_usage:
                        chunk["usage"] = usage(len(choice.prompt.ids), completion_tokens,
                                               choice.prompt.num_cached_tokens) if continuous else None
                    yield sse(chunk)
        if include_usage:
            yield sse({**head, "choices": [], "usage": job.usage()})
        yield DONE

    async def _choices(self, prompt: EnginePrompt) -> AsyncIterator[tuple[Choice, Delta]]:
        """One prompt's (choice, delta) pairs as its engine outputs come; its metrics once it ends."""
        failed = False
        self.serving.live.add(prompt.rid)
        if self.serving.log_requests:
            cut = self.serving.max_log_len  # (vLLM's --max-log-len: the prompt's first characters and ids)
            request_log.info("Received request %s: %d prompt tokens, prompt: %r, params: %s, prompt_token_ids: %s",
                             prompt.rid, len(prompt.ids), None if prompt.text is None else prompt.text[:cut],
                             prompt.params, prompt.ids[:cut])
        try:
            async for out in self.engine.generate({"prompt": prompt.text, "prompt_token_ids": prompt.ids,
                                                   "cache_salt": prompt.cache_salt}, prompt.params, prompt.rid,
                                                  priority=prompt.priority):
                prompt.num_cached_tokens, prompt.engine_metrics = out.num_cached_tokens, out.metrics
                if out.prompt_logprobs is not None:
                    prompt.prompt_logprobs = out.prompt_logprobs
                for completion in out.outputs:
                    choice = prompt.choices[completion.index]
                    delta = choice.update(completion)
                    self.serving.metrics.tokens(0 if choice.prompt_counted else len(prompt.ids), len(delta.token_ids),
                                                choice.gap if delta.token_ids else None)
                    choice.prompt_counted = True
                    yield choice, delta
        except Exception as exc:  # a failed request counts in no metric; one cut short (cancelled) is an abort
            failed = True
            if self.serving.log_requests:
                request_log.info("Failed request %s: %s: %s", prompt.rid, type(exc).__name__, exc)
            raise
        finally:
            self.serving.live.discard(prompt.rid)
            if not failed:
                if self.serving.log_requests:
                    request_log.info("Finished request %s: %s", prompt.rid, ", ".join(
                        f"{c.finish_reason or 'abort'} after {len(c.token_ids)} tokens" for c in prompt.choices))
                for c in prompt.choices:
                    self.serving.metrics.finished(c.finish_reason or "abort", len(c.token_ids),
                                                  prompt.arrival, c.first_token, c.end or time.monotonic(),
                                                  prompt_tokens=len(prompt.ids),
                                                  max_tokens=prompt.params.max_tokens, engine=prompt.engine_metrics)
                self.serving.metrics.prompt_finished(prompt.params.n)

    async def merged(self, job: Job) -> AsyncIterator[tuple[Choice, Delta]]:
        """Run every prompt of ``job`` at once; yield (choice, delta) as they come. Leaving aborts them.
        One prompt (the usual request) is iterated in place: no task and queue between it and the stream."""
        if len(job.prompts) == 1:
            async with contextlib.aclosing(self._choices(job.prompts[0])) as it:
                async for item in it:
                    yield item
            return
        queue: asyncio.Queue[tuple[Choice, Delta] | BaseException | None] = asyncio.Queue()

        async def pump(prompt: EnginePrompt) -> None:
            try:
                async with contextlib.aclosing(self._choices(prompt)) as it:
                    async for item in it:
                        queue.put_nowait(item)
            except Exception as exc:  # noqa: BLE001 - handed to the caller
                queue.put_nowait(exc)
            finally:
                queue.put_nowait(None)

        tasks = [asyncio.create_task(pump(p)) for p in job.prompts]
        try:
            running = len(tasks)
            while running:
                item = await queue.get()
                if item is None:
                    running -= 1
                elif isinstance(item, BaseException):
                    raise item
                else:
                    yield item
        finally:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    async def run_to_end(self, job: Job, request: Request) -> bool:
        """Run a non-streaming request; False if the client went away first (its requests are aborted); a 503 if
        the server's shutdown cut it short."""
        async def run() -> None:
            async with contextlib.aclosing(self.merged(job)) as it:
                async for _ in it:
                    pass

        work = await unless_disconnected(run(), request.receive)
        if work.cancelled():
            return False
        if work.exception() is not None:
            raise to_api_error(work.exception(), job.renames)
        cut = sum(c.finish_reason == "abort" for c in job.choices)
        if cut and self.serving.draining:  # (not a 200 that a client checking the status takes for an answer)
            raise APIError(503, f"the server shut down before this request finished ({cut} of {len(job.choices)} "
                                "completions cut short); send it again", code="shutting_down")
        return True

    # ------------------------------------------------------------------ checks every endpoint makes
    def check_unsupported(self, body: Body) -> None:
        if body.stream_options is not None and not body.stream:
            raise APIError(400, "stream_options: only for a streamed response; send stream=true or leave "
                                "stream_options out", "stream_options")
        if body.best_of not in (None, 1):
            raise APIError(400, f"best_of={body.best_of}: only best_of=1 is supported", "best_of", "unsupported")
        if body.use_beam_search:
            raise APIError(400, "use_beam_search=true: beam search is not supported", "use_beam_search",
                           "unsupported")
        if body.response_format is not None and body.response_format.type not in RESPONSE_FORMATS:
            raise APIError(400, f"response_format type {body.response_format.type!r}: expected one of "
                                f"{list(RESPONSE_FORMATS)}", "response_format", "unsupported")
        for field, harmless in body.refused_extensions.items():
            value = (body.model_extra or {}).get(field, harmless)
            if value is not None and not json_equal(value, harmless):
                why = body.refusal_reasons.get(field, "this vLLM extension is not supported here")
                raise APIError(400, f"{field}={value!r}: {why}; leave it out", field, "unsupported")
        ignored = sorted(set(body.model_extra or ()) - set(body.refused_extensions) - set(body.read_extensions))
        if ignored:  # (as vLLM: a misspelt field is otherwise silently without effect)
            log.warning("request fields ignored (not fields of this endpoint): %s", ", ".join(ignored))

    def sampling_kwargs(self, body: Body) -> dict[str, Any]:
        """SamplingParams fields both endpoints take alike; the checkpoint's generation_config.json
        sampling values stand in for fields the client left out (max_tokens apart: ``prepare``)."""
        kw: dict[str, Any] = {**self.serving.sampling_defaults, "output_kind": RequestOutputKind.DELTA}
        for name in ("temperature", "top_p", "presence_penalty", "frequency_penalty", "seed", "top_k", "min_p",
                     "repetition_penalty", "min_tokens", "stop", "stop_token_ids", "allowed_token_ids",
                     "bad_words", "truncate_prompt_tokens"):
            value = getattr(body, name)
            if value is not None:
                kw[name] = value
        kw["ignore_eos"] = bool(body.ignore_eos)
        kw["include_stop_str_in_output"] = bool(body.include_stop_str_in_output)
        kw["skip_special_tokens"] = body.skip_special_tokens is not False
        if body.logit_bias:
            bias: dict[int, float] = {}
            for key, value in body.logit_bias.items():  # values are finite (the protocol says so)
                if not (key.isascii() and key.isdigit()):  # (the document's pattern: no sign, space or "_")
                    raise APIError(400, f"logit_bias key {key!r}: expected a token id (a string of ASCII digits)",
                                   "logit_bias")
                if len(key.lstrip("0")) > len(str(self.serving.limits.vocab_size)):  # (and no huge int to parse)
                    raise APIError(400, f"logit_bias key {key[:40]!r}{'...' if len(key) > 40 else ''}: expected a "
                                        f"token id below {self.serving.limits.vocab_size}", "logit_bias")
                bias[int(key)] = max(-100.0, min(100.0, value))  # (an id past the vocabulary: the engine's 400)
            kw["logit_bias"] = bias
        structured = structured_outputs(body)
        if structured is not None:
            kw["structured_outputs"] = structured
        return kw

    def make_params(self, kw: dict[str, Any], renames: dict[str, str]) -> SamplingParams:
        try:
            params = SamplingParams(**kw)
            params.check_vocab(self.serving.limits.vocab_size, self.serving.limits.max_logprobs)
        except (ValueError, TypeError, NotImplementedError) as exc:
            raise to_api_error(exc, renames) from None
        return params

    def check_length(self, n_prompt: int, max_tokens: int | None, field: str, tokens_field: str,
                     param: str | None = None) -> int | None:
        """Reject a prompt (and max_tokens) that cannot fit; return the max_tokens to ask the engine for
        (when the client gave none and the KV pool holds less than the context, what the pool holds). ``field``
        names the prompt in the messages (``prompt[1]``), ``param`` (default ``field``) is the error's param."""
        limits = self.serving.limits
        limit = limits.max_model_len
        param = param or field
        if n_prompt == 0:
            raise APIError(400, f"{field}: the prompt is empty; expected at least one token", param)
        if n_prompt >= limit:
            raise APIError(400, f"This model's maximum context length is {limit} tokens, but {n_prompt} tokens "
                                f"are in the {field}, which leaves no room to generate; shorten the {field}",
                           param, "context_length_exceeded")
        if max_tokens is not None and n_prompt + max_tokens > limit:
            raise APIError(400, f"This model's maximum context length is {limit} tokens. However, you requested "
                                f"{n_prompt + max_tokens} tokens ({n_prompt} in the {field}, {max_tokens} in "
                                f"the completion). Reduce the length of the {field} or {tokens_field}.",
                           tokens_field, "context_length_exceeded")
        capacity = limits.num_kv_blocks * limits.block_size
        if max_tokens is None and capacity < limit and n_prompt < capacity:
            return capacity - n_prompt
        longest = n_prompt + (limit - n_prompt if max_tokens is None else max_tokens)
        need = limits.kv_blocks_needed(longest)
        if need > limits.num_kv_blocks:
            raise APIError(400, f"up to {longest} tokens ({n_prompt} in the {field}) need {need} KV blocks, but "
                                f"the pool holds {limits.num_kv_blocks}; lower {tokens_field}", tokens_field,
                           "context_length_exceeded")
        return max_tokens

    def prompt_logprobs(self, body: Body, choice: Choice) -> dict[str, Any]:
        """vLLM's ``prompt_logprobs`` of a choice's prompt when asked for: per position null (the first) or
        ``{token id: {"logprob", "rank", "decoded_token"}}``, the prompt's token and the top ones."""
        k = body.prompt_logprobs
        if k is None:
            return {}
        return {"prompt_logprobs": [None if pos is None else {
            str(t): {"logprob": finite(lp.logprob), "rank": lp.rank, "decoded_token": self.piece(t, lp)}
            for t, lp in pos.items()} for _, pos in cut_logprobs(choice.prompt_entries(), k)]}

    def piece(self, token: int, logprob: Logprob | None = None) -> str:
        """A token's text, as its logprob entry decoded it if it did."""
        if logprob is not None and logprob.decoded_token is not None:
            return logprob.decoded_token
        return self.serving.decode([token])

    def tokens_as_ids(self, body: Body) -> bool:
        """Whether ``body``'s logprobs name tokens by id (vLLM's ``return_tokens_as_token_ids``; left out: the
        server's default)."""
        asked = body.return_tokens_as_token_ids
        return self.serving.tokens_as_ids if asked is None else asked

    def token_entries(self, token_ids: list[int], entries: list[PositionLogprobs], k: int,
                      as_ids: bool = False) -> list[dict[str, Any]]:
        """OpenAI's per-token logprobs (chat's ``content``, a Responses text's ``logprobs``): each token with its
        ``k`` most likely alternatives (-1: every one the engine gave, the whole vocabulary); ``as_ids``: tokens named
        ``token_id:{id}`` (``bytes`` still those of the token's text)."""
        def entry(t: int, lp: Logprob | None) -> dict[str, Any]:
            return {"token": self.label(t, lp, as_ids), "logprob": finite(lp.logprob) if lp else NO_LOGPROB,
                    "bytes": list(self.piece(t, lp).encode())}

        out = []
        for tid, pos in zip(token_ids, entries):
            n = len(pos) if k == -1 else k
            top = sorted((lp.rank, t, lp) for t, lp in pos.items() if lp.rank is not None and lp.rank <= n)[:n]
            out.append({**entry(tid, pos.get(tid)), "top_logprobs": [entry(t, lp) for _, t, lp in top]})
        return out

    def label(self, token: int, logprob: Logprob | None, as_ids: bool) -> str:
        """A token as logprobs name it: ``token_id:{id}`` (two tokens of one text stay apart), or its text."""
        return f"token_id:{token}" if as_ids else self.piece(token, logprob)


def cut_logprobs(entries: list[tuple[int, PositionLogprobs | None]], k: int | None
                 ) -> list[tuple[int, PositionLogprobs | None]]:
    """Each position's logprobs cut to its token and the top ``k`` (the engine computed the largest count a
    request asked for: completions' ``echo`` with ``logprobs``, or ``prompt_logprobs``; -1: the whole
    vocabulary, uncut)."""
    if k is None or k == -1:
        return entries
    return [(t, pos if pos is None else {i: lp for i, lp in pos.items()
                                         if i == t or (lp.rank is not None and lp.rank <= k)})
            for t, pos in entries]
