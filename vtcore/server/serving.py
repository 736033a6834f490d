"""``Serving``: what every endpoint of one app shares."""
from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import time
from typing import TYPE_CHECKING, Any, Callable, Sequence, TypeVar

from vtcore.server.errors import APIError
from vtcore.server.metrics import ServerMetrics

if TYPE_CHECKING:
    from vtcore.engine.async_llm import AsyncLLM

#: ``vtcore serve --enable-log-requests``' log: a line as each generation request arrives and one as it ends
request_log = logging.getLogger("vtcore.server.requests")

In = TypeVar("In")
Out = TypeVar("Out")


class Serving:
    """The engine (only its front end: ``generate``, ``abort``, ``tokenize``, ``limits``, ``stats``,
    ...), the served model name, metrics, the engine requests in flight, the draining flag, and the
    threads that prepare requests off the event loop."""

    def __init__(self, engine: AsyncLLM, names: str | Sequence[str], chat_template: str | None = None,
                 tokens_as_ids: bool = False, log_requests: bool = False, *, response_role: str = "assistant",
                 force_include_usage: bool = False, max_log_len: int | None = None) -> None:
        self.engine = engine
        self.names = (names,) if isinstance(names, str) else tuple(names)  # (vLLM's aliases: the first is the name)
        self.name = self.names[0]
        self.chat_template = chat_template  # the served chat template (None: the tokenizer's)
        self.tokens_as_ids = tokens_as_ids  # logprobs name tokens "token_id:{id}" unless a request says otherwise
        self.log_requests = log_requests  # each generation request's arrival and end go to ``request_log``
        self.max_log_len = max_log_len  # the most prompt characters and ids a request's log line shows (None: all)
        self.response_role = response_role  # a chat reply's role where the prompt asks for a new message
        self.force_include_usage = force_include_usage  # every stream has usage in each chunk, asked for or not
        self.created = int(time.time())
        self.limits = engine.limits()
        # the engine's sampling defaults, fixed at its start: those a request's unset fields take, and max_tokens
        # apart (vLLM's rule: a request's own, else the default, then at most the cap)
        self.sampling_defaults = engine.default_sampling()
        self.default_max_tokens: int | None = self.sampling_defaults.pop("max_tokens", None)
        self.max_tokens_cap = engine.max_tokens_cap()
        self.metrics = ServerMetrics(self.name, engine.stats, self.limits.max_model_len)
        self.live: set[str] = set()  # engine request ids in flight
        self.draining = False  # shutting down: new requests get 503
        # Requests are validated and tokenized on these threads, off the event loop: a large prompt
        # takes seconds and would stall every stream. Several, so one large prompt holds up no other
        # request (fast tokenizers encode concurrently; the engine thread decodes meanwhile already).
        self.preparer = concurrent.futures.ThreadPoolExecutor(4, thread_name_prefix="vtcore-prepare")

    async def off_loop(self, fn: Callable[[In], Out], arg: In) -> Out:
        """``fn(arg)`` on a preparing thread."""
        return await asyncio.get_running_loop().run_in_executor(self.preparer, fn, arg)

    async def abort_all(self) -> int:
        """Abort every engine request in flight: streams end with finish_reason "abort" and [DONE],
        non-streaming requests answer 503 (``shutting_down``, while ``draining``). Returns how many were aborted."""
        ids = list(self.live)
        for rid in ids:
            await self.engine.abort(rid)
        return len(ids)

    @property
    def healthy(self) -> bool:
        return not self.draining and self.engine.healthy

    def check_serving(self) -> None:
        if self.draining:
            raise APIError(503, "the server is shutting down", code="shutting_down")

    def check_model(self, model: str | None) -> None:
        if model is not None and model not in self.names:
            served = " or ".join(repr(n) for n in self.names)
            raise APIError(404, f"The model {model!r} does not exist; this server serves {served} "
                                "(see GET /v1/models)", "model", "model_not_found")

    def model_name(self, asked: str | None) -> str:
        """The name a response carries: the one the request asked for (a served alias), else the first."""
        return asked if asked in self.names else self.name

    def model_card(self, name: str | None = None) -> dict[str, Any]:
        return {"id": name or self.name, "object": "model", "created": self.created, "owned_by": "vtcore",
                "root": self.engine.model, "parent": None, "max_model_len": self.limits.max_model_len}

    def decode(self, token_ids: list[int]) -> str:
        """The text of generated or prompt ids ("" without a tokenizer)."""
        return "" if self.engine.tokenizer is None else self.engine.detokenize(token_ids)
