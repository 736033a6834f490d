"""The engine core in a process of its own (vLLM V1's EngineCore), for ``AsyncLLM(engine_core_process=True)``.

An HTTP server and the engine loop in one process take turns on one interpreter: every step's host work
(scheduling, staging, sampling metadata, output processing) waits while the server parses requests and
writes streams, and the other way round. Here the ``LLMEngine`` runs in a process of its own (``core_main``)
and the front end keeps only what it needs of it (``CoreClient``: the tokenizer, the limits, the default
sampling values, the family, the latest load), so tokenizing, chat templates and the HTTP work stay in
the server's process.

One duplex pipe carries pickled messages. Front end to core: ``("add", id, pickled (prompt, params, priority))``
(``wire``: pickled apart, so the core unpickles them inside the add's own ``try``, and a request that does not
unpickle there fails alone instead of ending the core's loop), ``("abort",
id)``, ``("call", method)`` (one of ``ENGINE_CALLS``: the engine's method run between two steps), ``("stop",)``.
Core to front end: ``("ready", CoreInfo)`` once, then ``("added", id, prompt_as_sent)`` or ``("rejected", id,
error)`` for each add (a bad request fails alone), ``("answer", value)`` or ``("failed", error)`` for each call, in
order, ``("outputs", [packed RequestOutput], EngineStats)`` after each step (``pack_output``: plain tuples; a
request's prompt only in its first output, and not at all when ``prompt_as_sent`` said the engine runs the prompt
text and ids the add carried, which the front end then keeps; its text only if it has stop strings: the front end
detokenizes the others,
``vtcore.engine.front_end_text``; never waiting on a slow reader: see ``_Sender``),
``("stopped",)`` after a stop (every request aborted and finished; an add after a stop is rejected), or ``("dead",
error)`` when the engine raised (then it exits).
Between steps the core takes every message waiting; with no work it polls the pipe for ``IDLE_POLL_S``, then
blocks on it.
"""
from __future__ import annotations

import collections
import operator
import os
import pickle
import queue
import signal
import socket
import struct
import threading
import time
import weakref
from multiprocessing.connection import Connection
from multiprocessing.reduction import ForkingPickler
from typing import Any

import attrs

from vtcore.config import EngineConfig
from vtcore.engine.capacity import EngineLimits, EngineStats
from vtcore.engine.front_end_text import FrontEndText
from vtcore.engine.gil import favour_engine_thread
from vtcore.engine.prompt_text import PromptText
from vtcore.errors import EngineDeadError
from vtcore.family import ModelFamily
from vtcore.outputs import CompletionOutput, RequestMetrics, RequestOutput
from vtcore.worker.processes import pipe, start_child

#: seconds ``shutdown`` waits for the core to finish its requests and exit before it is killed
STOP_TIMEOUT_S = 30
#: the engine methods a front end may call between steps (``AsyncLLM``'s of the same names)
ENGINE_CALLS = ("reset_prefix_cache", "start_profile", "stop_profile")
#: a step's outputs for at most this many requests are pickled and sent on the step loop; more are the sender
#: thread's to pickle (it does while the loop waits on the device)
DIRECT_OUTPUTS = 8
#: seconds the idle core polls the pipe before it blocks on it: a request that comes within them is read by a
#: running process, not one the kernel must wake first (a closed loop's next request comes a served round trip,
#: a millisecond or two, after the last output)
IDLE_POLL_S = 0.005


@attrs.frozen
class CoreInfo:
    """What the front end needs of the engine the core built."""

    model_path: str  # the resolved checkpoint folder (its tokenizer is loaded from here, or ``tokenizer``)
    family: ModelFamily
    limits: EngineLimits
    default_sampling: dict[str, Any]
    eos_token_ids: list[int]
    stats: EngineStats


def _sendable(exc: BaseException) -> BaseException:
    """``exc`` itself if it survives pickling both ways (its type is kept: a ``RequestRejected`` stays one;
    an exception whose ``__init__`` takes other arguments than it passed on does not unpickle), else a
    ``RuntimeError`` with its type and text."""
    try:
        pickle.loads(pickle.dumps(exc))
        return exc
    except Exception:  # noqa: BLE001 - any exception that does not round-trip is described instead
        return RuntimeError(f"{type(exc).__name__}: {exc}")


_REQUEST_FIELDS = tuple(f.name for f in attrs.fields(RequestOutput))
_request_fields = operator.attrgetter(*_REQUEST_FIELDS)
_completion_fields = operator.attrgetter(*(f.name for f in attrs.fields(CompletionOutput)))
_metrics_fields = operator.attrgetter(*(f.name for f in attrs.fields(RequestMetrics)))
_PROMPT, _PROMPT_IDS, _OUTPUTS, _METRICS = (_REQUEST_FIELDS.index(name) for name in
                                            ("prompt", "prompt_token_ids", "outputs", "metrics"))


def pack_output(out: RequestOutput, announced: set[str]) -> tuple:
    """``out`` as sent: a tuple of its fields (its completions and metrics tuples too: pickling attrs
    instances costs 30 times as much, half a millisecond a step of 128 rows), without the prompt (text and
    ids: a long prompt's ids are most of a step's bytes) after the request's first output; the front end
    puts it back (``CoreClient.recv``)."""
    fields = list(_request_fields(out))
    fields[_OUTPUTS] = [_completion_fields(c) for c in out.outputs]
    fields[_METRICS] = _metrics_fields(out.metrics)
    rid = out.request_id
    if rid in announced:
        fields[_PROMPT], fields[_PROMPT_IDS] = None, []
    else:
        announced.add(rid)
    if out.finished:
        announced.discard(rid)
    return tuple(fields)


def unpack_output(fields: tuple) -> RequestOutput:
    """The ``RequestOutput`` that ``pack_output`` packed (its prompt as sent)."""
    fields = list(fields)
    fields[_OUTPUTS] = [CompletionOutput(*c) for c in fields[_OUTPUTS]]
    fields[_METRICS] = RequestMetrics(*fields[_METRICS])
    return RequestOutput(*fields)


def _frame(data: bytes) -> bytes:
    """``data`` framed as ``Connection.recv_bytes`` reads it: its length (4 bytes, big-endian; past 2 GiB -1 and
    8 bytes more), then ``data``."""
    n = len(data)
    return (struct.pack("!i", n) if n <= 0x7FFFFFFF else struct.pack("!iQ", -1, n)) + data


class _Sender:
    """Messages over one end of a ``multiprocessing.Pipe()`` (a socket pair), in order, never blocking the caller:
    the core's step loop never waits while the front end is slow to read, nor the front end's event loop while
    the core steps. A message goes out on the caller's thread when nothing is queued before it and the socket
    takes all of it at once (``MSG_DONTWAIT``); else it, or the part the socket did not take, is written by a
    thread of its own (a hand-off to a thread that must wake and take the GIL: on a request's path to its first
    token it cost 0.15-0.25 ms a hop, docs/BENCHMARKS.md). A write that fails (the other end is gone) ends the
    thread; that end's reader hears of it. ``send`` pickles on the caller's thread (a message that cannot be
    pickled fails its sender); ``send_later`` leaves the pickling to the thread too (a large step's outputs, off
    the core's step loop): one that cannot be pickled goes out as ``("dead", error)``, and every later send
    raises that error."""

    def __init__(self, conn: Connection) -> None:
        self.queue: queue.SimpleQueue = queue.SimpleQueue()
        self.sock = socket.socket(fileno=os.dup(conn.fileno()))  # the same socket, for sends that never block
        self.sock.settimeout(None)  # (a process's default timeout would make it, and so ``conn``, non-blocking)
        self.lock = threading.Lock()
        self.queued = 0  # messages handed to the thread and not yet written (under ``lock``)
        self.failed: BaseException | None = None  # why the thread could not pickle a message: every send raises it
        self.thread = threading.Thread(target=self._run, name="vtcore-sender", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        try:
            while (item := self.queue.get()) is not None:
                if not isinstance(item, (bytes, memoryview)):
                    try:
                        item = _frame(ForkingPickler.dumps(item))
                    except Exception as exc:  # noqa: BLE001 - the reader hears of it in the message's place
                        self.failed = RuntimeError(f"a message to the front end could not be pickled: "
                                                   f"{type(exc).__name__}: {exc}")
                        item = _frame(ForkingPickler.dumps(("dead", self.failed)))
                self.sock.sendall(item)
                if self.failed is not None:
                    return
                with self.lock:
                    self.queued -= 1
        except OSError:
            return  # the other end is gone
        finally:
            with self.lock:  # (not while a caller's send is on the socket)
                self.sock.close()

    def send(self, msg: tuple) -> None:
        self.send_pickled(ForkingPickler.dumps(msg))

    def send_pickled(self, data: bytes) -> None:
        """A message the caller pickled."""
        if self.failed is not None:
            raise self.failed
        frame: bytes | memoryview = _frame(data)
        with self.lock:
            if not self.queued:
                try:
                    sent = self.sock.send(frame, socket.MSG_DONTWAIT)
                except BlockingIOError:
                    sent = 0
                except OSError:
                    return  # the other end is gone (its reader hears of it)
                if sent == len(frame):
                    return
                frame = memoryview(frame)[sent:]
            self.queued += 1
            self.queue.put(frame)

    def send_later(self, msg: tuple) -> None:
        """A message the thread pickles and writes."""
        if self.failed is not None:
            raise self.failed
        with self.lock:
            self.queued += 1
            self.queue.put(msg)

    def close(self, timeout: float | None = None) -> None:
        """Send what is queued, then stop (waiting at most ``timeout`` seconds for a reader that reads)."""
        self.queue.put(None)
        self.thread.join(timeout)


def _prompt_as_sent(engine: Any, request_id: str, prompt: Any) -> bool:
    """Whether the engine's request ``request_id`` runs on the text and token ids its add's ``prompt`` dict gave
    (not truncated; one sample: an ``n > 1`` request's outputs come from its samples)."""
    req = engine.requests.get(request_id)
    if req is None or not isinstance(prompt, dict):
        return False
    text, ids = prompt.get("prompt"), prompt.get("prompt_token_ids")
    try:  # (a text that is no str, ids that compare oddly: sent back as any other prompt, never a failure)
        return (text is None or isinstance(text, str)) and isinstance(ids, list) and req.prompt == text \
            and bool(req.prompt_token_ids == ids)
    except Exception:  # noqa: BLE001 - see above
        return False


def _poll_awhile(conn: Connection, seconds: float) -> None:
    """Return once a message waits on ``conn``, or ``seconds`` later, without sleeping in between."""
    deadline = time.perf_counter() + seconds
    while not conn.poll(0) and time.perf_counter() < deadline:
        pass


def core_main(config: EngineConfig, conn: Connection) -> None:
    """The core process: build the engine, report it, then serve the pipe until a stop or a failure."""
    from vtcore.engine.llm_engine import LLMEngine
    from vtcore.worker.tensor_parallel import thread_lock_for_progress

    thread_lock_for_progress()
    favour_engine_thread()  # (the sender thread pickles outputs beside the engine loop)
    # The front end stops the core (a terminal's Ctrl-C reaches both processes: the server's graceful shutdown
    # needs the core running, and a KeyboardInterrupt could cut a message in two on the pipe).
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        engine = LLMEngine(config)
    except BaseException as exc:  # noqa: BLE001 - the front end raises it from the constructor
        conn.send(("dead", _sendable(exc)))
        return
    engine.front_end_text = True
    conn.send(("ready", CoreInfo(engine.model_path, engine.family, engine.limits(), engine.default_sampling(),
                                 list(engine.eos_token_ids), engine.stats())))
    sender = _Sender(conn)
    stopping = False
    announced: set[str] = set()  # requests whose prompt the front end has (sent with the add, or a first output)
    try:
        while True:
            if not (stopping or engine.has_unfinished_requests()):
                _poll_awhile(conn, IDLE_POLL_S)
            while conn.poll(0) or not (stopping or engine.has_unfinished_requests()):
                msg = conn.recv()
                if msg[0] == "add" and stopping:
                    sender.send(("rejected", msg[1], EngineDeadError("the engine is shutting down")))
                elif msg[0] == "add":
                    try:
                        prompt, params, priority = pickle.loads(msg[2])
                        engine.add_request(msg[1], prompt, params, priority)
                    except Exception as exc:  # noqa: BLE001 - a bad request fails alone
                        sender.send(("rejected", msg[1], _sendable(exc)))
                    else:
                        as_sent = _prompt_as_sent(engine, msg[1], prompt)
                        if as_sent:  # (the front end has it: a long prompt's ids are most of a first output's bytes)
                            announced.add(msg[1])
                        sender.send(("added", msg[1], as_sent))
                elif msg[0] == "abort":
                    engine.abort_request(msg[1])
                elif msg[0] == "call":
                    try:
                        if msg[1] not in ENGINE_CALLS:
                            raise ValueError(f"{msg[1]!r} is not an engine call; expected one of {ENGINE_CALLS}")
                        sender.send(("answer", getattr(engine, msg[1])()))
                    except Exception as exc:  # noqa: BLE001 - the caller's to raise (a profile not started, ...)
                        sender.send(("failed", _sendable(exc)))
                else:  # stop: abort everything, finish the steps in flight
                    stopping = True
                    for rid in list(engine.requests):
                        engine.abort_request(rid)
            if engine.has_unfinished_requests():
                outputs = engine.step()
                msg = ("outputs", [pack_output(out, announced) for out in outputs], engine.stats())
                sender.send(msg) if len(outputs) <= DIRECT_OUTPUTS else sender.send_later(msg)
            elif stopping:
                sender.send(("stopped",))
                return
    except BaseException as exc:  # noqa: BLE001 - every waiter on the front end must hear about it
        sender.send(("dead", _sendable(exc)))
    finally:
        sender.close()
        engine.shutdown()


def wire(msg: tuple) -> tuple:
    """A message to the core as the pipe carries it: an add's prompt, params and priority pickled apart."""
    return ("add", msg[1], pickle.dumps(msg[2:], protocol=pickle.HIGHEST_PROTOCOL)) if msg[0] == "add" else msg


class CoreClient(PromptText):
    """The front end's view of an engine core process: what ``EngineFrontEnd`` reads of an engine
    (``config``, ``tokenizer``, ``family``, ``limits``, ...), and ``send`` for the messages above; the
    core's messages are read by one thread (``recv``)."""

    def __init__(self, config: EngineConfig) -> None:
        from vtcore.engine.tokenizer import engine_tokenizer

        self.config = config
        ours, theirs = pipe()
        # not a daemon: a daemon may not start processes, and the core starts its tensor-parallel workers
        self.process = start_child(core_main, (config, theirs), "vtcore-engine-core", daemon=False,
                                   preload=("vtcore.engine.llm_engine",))
        theirs.close()
        self.conn = ours
        try:
            msg = self.conn.recv()
        except EOFError:
            self.process.join()
            raise EngineDeadError(f"the engine core process exited while starting (exit code "
                                  f"{self.process.exitcode})") from None
        if msg[0] == "dead":
            self.process.join()
            raise msg[1]
        self._sender = _Sender(ours)  # (once the core runs: a core that failed to start leaves no sender thread)
        # a program that never calls shutdown: stopped at exit (before multiprocessing joins its children)
        self._finalizer = weakref.finalize(self, _stop, self.process, self._sender)
        self._send_lock = threading.Lock()
        # per request id, the (params, prompt) of each add not answered yet, in the order sent (under its own lock:
        # the receiving thread never waits on a caller's pickling)
        self._unanswered_lock = threading.Lock()
        self._unanswered: dict[str, collections.deque[tuple[Any, Any]]] = collections.defaultdict(collections.deque)
        self._prompts: dict[str, tuple[str | None, list[int]]] = {}  # a running request's prompt (see pack_output)
        info: CoreInfo = msg[1]
        self.info, self.family, self.vocab_size = info, info.family, info.limits.vocab_size
        self.latest_stats = info.stats
        self.tokenizer = engine_tokenizer(config, info.model_path)
        self.text = FrontEndText(self.tokenizer, self.info.eos_token_ids)

    def send(self, msg: tuple) -> None:
        """Send a message to the core (from any thread; never blocking: see ``_Sender``)."""
        with self._send_lock:
            data = ForkingPickler.dumps(wire(msg))  # a message that cannot be pickled fails here, its sender's call
            if msg[0] == "add":
                with self._unanswered_lock:
                    self._unanswered[msg[1]].append((msg[3], msg[2]))
            self._sender.send_pickled(data)

    def recv(self) -> tuple:
        """The core's next message (the receiving thread only); ``EOFError`` / ``OSError`` once it is gone."""
        msg = self.conn.recv()
        if msg[0] == "outputs":
            self.latest_stats = msg[2]
            msg = (msg[0], [unpack_output(fields) for fields in msg[1]], msg[2])
            for out in msg[1]:  # ours to complete
                rid = out.request_id
                kept = self._prompts.get(rid)
                if kept is None:
                    self._prompts[rid] = (out.prompt, out.prompt_token_ids)
                else:
                    out.prompt, out.prompt_token_ids = kept
                if out.finished:
                    self._prompts.pop(rid, None)
                self.text.fill(out)
        elif msg[0] in ("added", "rejected"):
            rid = msg[1]
            with self._unanswered_lock:
                waiting = self._unanswered[rid]
                params, prompt = waiting.popleft()
                if not waiting:
                    del self._unanswered[rid]
            if msg[0] == "added":
                self.text.added(rid, params)
                if msg[2]:  # the core sends no prompt: ours is the one it runs (a copy: the caller's may change)
                    self._prompts[rid] = (prompt.get("prompt"), list(prompt["prompt_token_ids"]))
        return msg

    def limits(self) -> EngineLimits:
        return self.info.limits

    def default_sampling(self) -> dict[str, Any]:
        return dict(self.info.default_sampling)

    def stats(self) -> EngineStats:
        """The load after the core's latest step."""
        return self.latest_stats

    @property
    def eos_token_ids(self) -> list[int]:
        return self.info.eos_token_ids

    def shutdown(self) -> None:
        """Wait for the core to exit (after a stop), killing it past ``STOP_TIMEOUT_S``."""
        self._finalizer.detach()
        self._sender.close(STOP_TIMEOUT_S)
        _join(self.process)
        self.conn.close()


def _join(process: Any) -> None:
    process.join(timeout=STOP_TIMEOUT_S)
    if process.is_alive():
        process.kill()
        process.join()


def _stop(process: Any, sender: _Sender) -> None:
    """Stop a core its front end never shut down."""
    if process.is_alive():
        sender.send(("stop",))
        sender.close(STOP_TIMEOUT_S)
        _join(process)
