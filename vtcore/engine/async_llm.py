"""``AsyncLLM``: an asyncio front end over the engine loop (vLLM's shape).

The engine runs on its own thread: it takes new requests and aborts from an inbox between steps
and runs ``LLMEngine.step`` (a batch queue of depth 2 when async scheduling is on) while there is
work. With ``engine_core_process=True`` it runs in a process of its own instead
(:mod:`vtcore.engine.core_process`) and the thread only receives its messages; requests and aborts
go to it straight from ``generate``. Outputs are handed to each request's ``_Pending`` on the
caller's event loop, where one not yet taken merges with the next (vLLM's ``RequestOutputCollector``).
Each request runs in the engine under an id of its own (the caller's id and a serial number, as vLLM's
internal request ids): a caller may reuse an id once its request ended, even one it left early whose abort
the engine has not reported yet, and no stale output reaches the new request's stream.
A bad request fails alone (its ``generate`` raises); if the loop (or the core
process) dies, every pending ``generate`` raises ``EngineDeadError``, and so does every later call.
"""
from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import itertools
import logging
import queue
import threading
from typing import Any, AsyncIterator, Iterable

from vtcore.engine.arg_utils import engine_config
from vtcore.engine.core_process import ENGINE_CALLS, CoreClient
from vtcore.engine.front_end import EngineFrontEnd, refuse_lora
from vtcore.engine.gil import favour_engine_thread
from vtcore.engine.llm_engine import LLMEngine, Prompt
from vtcore.errors import EngineDeadError
from vtcore.outputs import RequestOutput
from vtcore.sampling_params import RequestOutputKind, SamplingParams

log = logging.getLogger("vtcore")


class AsyncLLM(EngineFrontEnd):
    """``generate`` streams a request's outputs; the front-end methods (``tokenize``, ``limits``,
    ``stats``, ...) come from ``EngineFrontEnd``."""

    def __init__(self, model: str | None = None, engine_core_process: bool = False, **kwargs: Any) -> None:
        """``engine_core_process``: run the engine in a process of its own (module docstring)."""
        config = engine_config("AsyncLLM", model, kwargs)
        self.core: CoreClient | None = CoreClient(config) if engine_core_process else None
        self.engine = self.core or LLMEngine(config)
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._wake = threading.Event()
        self._lock = threading.Lock()
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, _Pending]] = {}  # by engine id
        self._engine_ids: dict[str, str] = {}  # a caller's id -> the engine id of its unfinished request
        self._serial = itertools.count()
        # engine ids whose add is not sent yet (their grammar compiles) -> whether an abort came meanwhile
        self._unsent: dict[str, bool] = {}
        # adds sent to the core process and not answered yet, per request id in the order sent (a caller that
        # left before its answer may reuse its id; the core answers adds in order)
        self._adds: dict[str, collections.deque[concurrent.futures.Future]] = {}
        self._calls: collections.deque[concurrent.futures.Future] = collections.deque()  # sent, not answered
        self._stopping = False
        self.dead: BaseException | None = None
        if self.core is None:  # the engine loop shares this process's GIL with the caller's event loop
            favour_engine_thread()
        self._thread = threading.Thread(target=self._loop if self.core is None else self._receive,
                                        name="vtcore-engine", daemon=True)
        self._thread.start()

    @property
    def healthy(self) -> bool:
        """True while the engine loop runs and takes requests (not dead, not shut down)."""
        return self.dead is None and not self._stopping and self._thread.is_alive()

    @property
    def is_running(self) -> bool:
        """vLLM's: the engine takes requests (``healthy``)."""
        return self.healthy

    @property
    def is_stopped(self) -> bool:
        """vLLM's: the engine was shut down or died."""
        return self._stopping or self.dead is not None

    @property
    def errored(self) -> bool:
        """vLLM's: the engine loop (or the core process) died."""
        return self.dead is not None

    @property
    def dead_error(self) -> EngineDeadError:
        """vLLM's: the error every call raises once the engine died."""
        return EngineDeadError(f"the engine loop died: {type(self.dead).__name__}: {self.dead}" if self.dead
                               else "the engine is shut down")

    async def check_health(self) -> None:
        """vLLM's: raise ``EngineDeadError`` unless the engine takes requests."""
        if not self.healthy:
            raise self.dead_error

    async def get_tokenizer(self) -> Any:
        """vLLM's: the checkpoint's Hugging Face tokenizer (None when it has none)."""
        return self.tokenizer

    # ------------------------------------------------------------------ caller side
    def _check_alive(self) -> None:
        if self.dead is not None:
            raise EngineDeadError(f"the engine loop died: {type(self.dead).__name__}: {self.dead}") from self.dead
        if self._stopping:
            raise EngineDeadError("the engine is shut down")

    async def generate(self, prompt: Prompt, sampling_params: SamplingParams | None = None,
                       request_id: str | None = None, *, priority: int = 0,
                       lora_request: Any = None) -> AsyncIterator[RequestOutput]:
        """Stream a request's outputs (cumulative, or deltas with ``output_kind=DELTA``) until it finishes.
        ``priority`` (vLLM's): under ``scheduling_policy="priority"``, lower values are scheduled first.
        ``lora_request`` (vLLM's) must be None: no adapters.

        Leaving the loop early (a client that disconnects) aborts the request and frees its blocks.
        """
        self._check_alive()
        refuse_lora(lora_request)
        if not isinstance(request_id, str):
            raise ValueError(f"request_id={request_id!r}: expected a unique string")
        if sampling_params is None:
            sampling_params = self.get_default_sampling_params()
        elif not isinstance(sampling_params, SamplingParams):
            raise ValueError(f"sampling_params={sampling_params!r}: expected a SamplingParams or None (the "
                             "checkpoint's generation_config.json values)")
        loop = asyncio.get_running_loop()
        stream = _Pending(aggregate=sampling_params.output_kind == RequestOutputKind.DELTA)
        with self._lock:
            if request_id in self._engine_ids:
                raise ValueError(f"request_id={request_id!r}: already in use by an unfinished request")
            engine_id = self._engine_ids[request_id] = f"{request_id}-{next(self._serial)}"
            self._streams[engine_id] = (loop, stream)
            self._unsent[engine_id] = False
        constraint = sampling_params.structured_outputs
        if constraint is not None and not self.engine.grammar_compiled(constraint):
            try:  # compiled (once per distinct constraint) off the engine thread; add_request finds it cached
                await loop.run_in_executor(None, self.engine.compile_grammar, constraint)
            except BaseException:
                self._forget(request_id, engine_id)
                raise
        added: concurrent.futures.Future = concurrent.futures.Future()
        finished = False
        try:
            with self._lock:
                aborted = self._unsent.pop(engine_id)
            self._submit(("add", engine_id, prompt, sampling_params, priority, added))
            if aborted:  # while its grammar compiled: aborted once added, so it ends as any aborted request
                self._submit(("abort", engine_id))
            try:
                await asyncio.wrap_future(added)
            except Exception as exc:  # a rejection names the request as its caller does
                exc.args = tuple(a.replace(engine_id, request_id) if isinstance(a, str) else a for a in exc.args)
                raise
            while not finished:
                item = await stream.get()
                if isinstance(item, BaseException):
                    raise item
                finished = item.finished
                item.request_id = request_id
                yield item
        finally:
            self._forget(request_id, engine_id)
            # Left early: abort unless the request was never added (cancelled in the inbox, or
            # rejected). The abort queues behind the add, so it also covers an add still running.
            if not finished and not added.cancelled() and not (added.done() and added.exception() is not None):
                self._submit(("abort", engine_id))

    async def reset_prefix_cache(self) -> bool:
        """Forget every cached KV block and state snapshot between two of the engine's steps (vLLM's); requests
        running meanwhile keep their blocks, which are no longer offered to later prompts. True when prefix
        caching is on."""
        return await self._call("reset_prefix_cache")

    async def start_profile(self) -> None:
        """Record the engine's steps from now on with torch.profiler (vLLM's; needs ``profiler_config``)."""
        await self._call("start_profile")

    async def stop_profile(self) -> str:
        """End the recording; returns the trace file's path (:mod:`vtcore.engine.profiler`)."""
        return await self._call("stop_profile")

    async def _call(self, method: str) -> Any:
        """``engine.<method>()`` between two of its steps (on the engine thread, or in the core process); what
        it raises is raised here."""
        if method not in ENGINE_CALLS:
            raise ValueError(f"AsyncLLM: {method!r} is not an engine call; expected one of {ENGINE_CALLS}")
        self._check_alive()
        done: concurrent.futures.Future = concurrent.futures.Future()
        self._submit(("call", method, done))
        return await asyncio.wrap_future(done)

    def _forget(self, request_id: str, engine_id: str) -> None:
        with self._lock:
            self._streams.pop(engine_id, None)
            self._engine_ids.pop(request_id, None)
            self._unsent.pop(engine_id, None)

    async def abort(self, request_id: str | Iterable[str]) -> None:
        """Abort a request, or each of several (vLLM's); its stream ends with ``finish_reason="abort"``. An id
        with no unfinished request is ignored (as vLLM does)."""
        ids = [request_id] if isinstance(request_id, str) else list(request_id) \
            if isinstance(request_id, Iterable) else None
        if ids is None or not all(isinstance(rid, str) for rid in ids):
            raise ValueError(f"request_id={request_id!r}: expected a request id (a string) or several")
        for rid in ids:
            with self._lock:
                engine_id = self._engine_ids.get(rid)
                if engine_id in self._unsent:  # its add is not sent: the add sends the abort after it
                    self._unsent[engine_id] = True
                    continue
            if engine_id is not None:
                self._submit(("abort", engine_id))

    def _submit(self, msg: tuple) -> None:
        """An add or an engine call (its last item the future its caller awaits) or an abort: into the engine thread's
        inbox, or straight to the core process (the future is then running: only the core's answer ends it)."""
        if self.core is None:
            self._inbox.put(msg)
            self._wake.set()
            if not self._thread.is_alive():  # (the loop ended after the caller's check: no one would answer)
                self._refuse_inbox(EngineDeadError("the engine is shut down"))
            return
        if msg[0] in ("add", "call"):
            answer = msg[-1]
            answer.set_running_or_notify_cancel()
            with self._lock:
                if self.dead is not None:  # died since the caller checked: no one would answer this message
                    raise EngineDeadError(f"the engine loop died: {type(self.dead).__name__}: {self.dead}")
                if msg[0] == "call":  # answered in the order sent: queued for the pipe under the lock that orders them
                    self._calls.append(answer)
                    self.core.send(msg[:-1])
                    return
                self._adds.setdefault(msg[1], collections.deque()).append(answer)
            msg = msg[:-1]
        try:
            self.core.send(msg)
        except BaseException:  # (a prompt that cannot be pickled): the add was never sent
            if msg[0] == "add":
                with self._lock:
                    self._answered(msg[1])
            raise

    def _answered(self, request_id: str) -> concurrent.futures.Future:
        """The oldest unanswered add of ``request_id`` (under ``_lock``)."""
        waiting = self._adds[request_id]
        added = waiting.popleft()
        if not waiting:
            del self._adds[request_id]
        return added

    def shutdown(self) -> None:
        """Stop the loop: in-flight requests are aborted; pending ``generate`` calls end."""
        self._stopping = True
        self._wake.set()
        if self.core is not None and self.dead is None:
            self.core.send(("stop",))
        self._thread.join(timeout=30)
        self.engine.shutdown()

    # ------------------------------------------------------------------ engine thread
    def _deliver(self, items: list[tuple[str, RequestOutput | BaseException]]) -> None:
        """(request id, output or error) pairs, handed over in one call per event loop: each call wakes its
        loop (a write to its self-pipe), and a step of a large batch would otherwise wake it once per request."""
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[_Pending, RequestOutput | BaseException]]] = {}
        with self._lock:
            for request_id, item in items:
                target = self._streams.get(request_id)
                if target is not None:
                    by_loop.setdefault(target[0], []).append((target[1], item))
        for loop, items in by_loop.items():
            loop.call_soon_threadsafe(_put_all, items)

    def _drain_inbox(self) -> None:
        while True:
            try:
                msg = self._inbox.get_nowait()
            except queue.Empty:
                return
            if msg[0] == "add":
                _, rid, prompt, params, priority, added = msg
                if not added.set_running_or_notify_cancel():  # its caller left before it was added
                    continue
                try:
                    self.engine.add_request(rid, prompt, params, priority)
                except Exception as exc:  # a bad request fails alone
                    added.set_exception(exc)
                else:
                    added.set_result(None)
            elif msg[0] == "call":
                done = msg[2]
                if done.set_running_or_notify_cancel():
                    try:
                        done.set_result(getattr(self.engine, msg[1])())
                    except Exception as exc:  # noqa: BLE001 - the caller's (a profile not started, ...)
                        done.set_exception(exc)
            else:
                self.engine.abort_request(msg[1])

    def _loop(self) -> None:
        try:
            while not self._stopping:
                self._drain_inbox()
                if self.engine.has_unfinished_requests():
                    self._deliver([(out.request_id, out) for out in self.engine.step()])
                else:
                    self._wake.wait()
                    self._wake.clear()
            for rid in list(self.engine.requests):
                self.engine.abort_request(rid)
            while self.engine.has_unfinished_requests():
                self._deliver([(out.request_id, out) for out in self.engine.step()])
            self._refuse_inbox(EngineDeadError("the engine is shut down"))
        except BaseException as exc:  # noqa: BLE001 - every waiter must hear about it
            self._die(exc)

    def _receive(self) -> None:
        """The thread's loop with an engine core process: hand its outputs and answers on."""
        try:
            while True:
                msg = self.core.recv()
                if msg[0] == "outputs":
                    self._deliver([(out.request_id, out) for out in msg[1]])
                elif msg[0] in ("added", "rejected"):
                    with self._lock:
                        added = self._answered(msg[1])
                    added.set_result(None) if msg[0] == "added" else added.set_exception(msg[2])
                elif msg[0] in ("answer", "failed"):
                    with self._lock:
                        done = self._calls.popleft()
                    done.set_result(msg[1]) if msg[0] == "answer" else done.set_exception(msg[1])
                elif msg[0] == "stopped":  # what was sent after the stop is never answered
                    with self._lock:
                        left = [a for waiting in self._adds.values() for a in waiting] + list(self._calls)
                        self._adds, self._calls = {}, collections.deque()
                    for answer in left:
                        answer.set_exception(EngineDeadError("the engine is shut down"))
                    return
                else:
                    raise msg[1]
        except (EOFError, OSError):
            self.core.process.join(timeout=5)  # reaped: its exit code
            self._die(EngineDeadError(f"the engine core process exited (exit code {self.core.process.exitcode})"))
        except BaseException as exc:  # noqa: BLE001 - the core's failure, sent before it exited
            self._die(exc)

    def _die(self, exc: BaseException) -> None:
        """The loop (or the core) died of ``exc``: every pending ``generate`` and later call raises."""
        self.dead = exc
        log.error("vtcore: engine loop died: %s: %s", type(exc).__name__, exc)
        with self._lock:
            ids = list(self._streams)
            answers = [a for waiting in self._adds.values() for a in waiting] + list(self._calls)
            self._adds, self._calls = {}, collections.deque()
        err = EngineDeadError(f"the engine loop died: {type(exc).__name__}: {exc}")
        self._deliver([(rid, err) for rid in ids])
        for answer in answers:
            answer.set_exception(err)
        self._refuse_inbox(err)  # requests that arrived after the death

    def _refuse_inbox(self, err: BaseException) -> None:
        """Fail every add and call still in the inbox (the loop ended) with ``err``."""
        while True:
            try:
                msg = self._inbox.get_nowait()
            except queue.Empty:
                return
            if msg[0] in ("add", "call") and msg[-1].set_running_or_notify_cancel():
                msg[-1].set_exception(err)


class _Pending:
    """A request's outputs not yet taken by its ``generate`` loop (on that loop's thread). As vLLM's
    ``RequestOutputCollector``: an output that comes before the last one was taken merges into it
    (``RequestOutput.add``; deltas appended when ``aggregate``), so a consumer that falls behind (an event loop
    at its limit under many streams) takes one output carrying every token since, not one a step, and the
    tokens reach its client as they would have; an error replaces whatever was pending."""

    def __init__(self, aggregate: bool) -> None:
        self.aggregate = aggregate
        self.item: RequestOutput | BaseException | None = None
        self.ready = asyncio.Event()

    def put(self, item: RequestOutput | BaseException) -> None:
        if self.item is None or isinstance(item, BaseException):
            self.item = item
        elif not isinstance(self.item, BaseException):
            self.item.add(item, self.aggregate)
        self.ready.set()

    async def get(self) -> RequestOutput | BaseException:
        if self.item is None:
            self.ready.clear()
            await self.ready.wait()
        item, self.item = self.item, None
        return item


def _put_all(items: list[tuple[_Pending, RequestOutput | BaseException]]) -> None:
    for stream, item in items:
        stream.put(item)
