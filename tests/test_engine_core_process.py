"""``AsyncLLM(engine_core_process=True)``: the engine in a process of its own (``vtcore.engine.core_process``).
It streams what the engine thread streams, a bad request fails alone, a caller that leaves early aborts its
request in the core, the front end tokenizes and reports limits and load without the engine, the server
and the real ``openai`` client work over it, a core runs tensor-parallel workers, a core that dies ends
every pending request with ``EngineDeadError``, a core that cannot start raises its error, and shutdown
leaves no process."""
from __future__ import annotations

import asyncio
import collections
import multiprocessing
import os
import signal
from typing import Any, Iterator

import attrs
import httpx
import pytest

from tests.server_harness import KNOBS, MODEL, MAX_BYTES, ServerThread, needs_default_model
from vtcore import AsyncLLM, SamplingParams
from vtcore.errors import EngineDeadError
from vtcore.sampling_params import RequestOutputKind

pytestmark = needs_default_model
PROMPTS = ["The meaning of life is", "A friend is", "Once upon a time"]


def greedy(n: int, **kw: Any) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, **kw)


async def _collect(llm: AsyncLLM, rid: str, prompt: Any, params: SamplingParams) -> list:
    return [o async for o in llm.generate(prompt, params, rid)]


def _on_thread_and_core(core: AsyncLLM, cases: list[tuple[Any, SamplingParams]]) -> tuple[list, list, AsyncLLM]:
    """Each (prompt, params) case's outputs from ``core`` and from an engine thread, run at once on each; and
    that engine (shut down)."""
    async def run(llm: AsyncLLM) -> list:
        return await asyncio.gather(*[_collect(llm, f"c{i}", prompt, params) for i, (prompt, params) in
                                      enumerate(cases)])

    thread = AsyncLLM(**KNOBS)
    try:
        want = asyncio.run(run(thread))
    finally:
        thread.shutdown()
    return asyncio.run(run(core)), want, thread


@pytest.fixture(scope="module")
def core() -> Iterator[AsyncLLM]:
    llm = AsyncLLM(**KNOBS, engine_core_process=True)
    yield llm
    llm.shutdown()


def test_it_streams_what_the_engine_thread_streams(core: AsyncLLM) -> None:
    """Text included: the core detokenizes only requests with stop strings, the front end the others (each
    completion of n, every output kind, special tokens kept or skipped)."""
    sampled = SamplingParams(temperature=1.0, seed=5, n=2, max_tokens=7, ignore_eos=True)
    cases = [greedy(9, output_kind=RequestOutputKind.DELTA), greedy(13), greedy(14, skip_special_tokens=False),
             sampled, attrs.evolve(sampled, output_kind=RequestOutputKind.DELTA),
             greedy(6, output_kind=RequestOutputKind.FINAL_ONLY), greedy(20, stop=["e"]),
             greedy(20, stop=["e"], include_stop_str_in_output=True, output_kind=RequestOutputKind.DELTA)]

    got, want, thread = _on_thread_and_core(core, [(PROMPTS[i % len(PROMPTS)], p) for i, p in enumerate(cases)])

    def seen(streams: list) -> list:
        return [[(o.prompt, o.prompt_token_ids, o.finished, [(c.index, c.token_ids, c.text, c.finish_reason,
                                                               c.stop_reason) for c in o.outputs]) for o in s]
                for s in streams]

    assert seen(got) == seen(want)  # the prompt too, in every output (the core sends it once)
    assert all(c.text for s, params in zip(got, cases) if not params.stop and params.output_kind !=
               RequestOutputKind.DELTA for c in s[-1].outputs)  # text there is (the front end made it)
    assert got[-2][-1].outputs[0].finish_reason == "stop"  # a stop string, found in the core
    assert core.tokenize(PROMPTS[0]) == thread.tokenize(PROMPTS[0]) and core.limits() == thread.limits()
    assert core.default_sampling() == thread.default_sampling() and core.engine.family.name == "qwen3_dense"
    assert core.stats().prefix_cache_queries > 0  # the core's load, sent with its steps


def test_prompts_given_as_ids_stream_what_the_engine_thread_streams(core: AsyncLLM) -> None:
    """A prompt of ids (with its text, as the server sends it, or without) is not sent back by the core, whose
    outputs carry the one the front end sent; a truncated one is the core's to send."""
    ids = core.tokenize(PROMPTS[2])[1]
    cases = [({"prompt_token_ids": ids}, greedy(4)), ({"prompt": PROMPTS[2], "prompt_token_ids": ids}, greedy(5)),
             ({"prompt": PROMPTS[2], "prompt_token_ids": ids}, greedy(3, truncate_prompt_tokens=2)),
             ({"prompt_token_ids": ids}, SamplingParams(temperature=1.0, seed=3, n=2, max_tokens=3, ignore_eos=True,
                                                         output_kind=RequestOutputKind.DELTA))]

    got, want, _ = _on_thread_and_core(core, cases)
    assert [[(o.prompt, o.prompt_token_ids, [(c.index, c.token_ids, c.text) for c in o.outputs]) for o in s]
            for s in got] == [[(o.prompt, o.prompt_token_ids, [(c.index, c.token_ids, c.text) for c in o.outputs])
                               for o in s] for s in want]
    assert got[2][0].prompt_token_ids == ids[-2:] and got[1][0].prompt == PROMPTS[2]


def test_a_prompt_text_that_does_not_compare_is_served_and_harms_no_one(core: AsyncLLM) -> None:
    """The engine keeps a prompt's text as given beside its ids; the core's check of what it runs as sent must not
    raise on one whose comparison has no truth value (it did: the core died, and every request with it)."""
    import numpy as np

    ids = core.tokenize(PROMPTS[1])[1]

    async def run() -> tuple[list, list]:
        odd = await _collect(core, "odd", {"prompt": np.array(["x", "y"]), "prompt_token_ids": ids}, greedy(2))
        return odd, await _collect(core, "plain", PROMPTS[0], greedy(2))

    odd, plain = asyncio.run(run())
    assert odd[-1].prompt_token_ids == ids and len(odd[-1].outputs[0].token_ids) == 2 and plain[-1].finished


def test_the_core_sends_back_only_a_prompt_it_does_not_run_as_sent() -> None:
    """On the wire: the first output of a prompt the core runs as its add carried it holds no prompt (a long
    prompt's ids were most of its bytes, on the path to the first token); a truncated one's does."""
    from vtcore.engine.arg_utils import engine_config
    from vtcore.engine.core_process import _PROMPT, _PROMPT_IDS, core_main, wire
    from vtcore.worker.processes import pipe, start_child

    ours, theirs = pipe()
    process = start_child(core_main, (engine_config("AsyncLLM", None, dict(KNOBS)), theirs), "core", daemon=False)
    theirs.close()
    try:
        assert ours.recv()[0] == "ready"
        ours.send(wire(("add", "kept", {"prompt": "abc", "prompt_token_ids": [5, 6, 7]}, greedy(2), 0)))
        ours.send(wire(("add", "cut", {"prompt": "abc", "prompt_token_ids": [5, 6, 7]},
                        greedy(2, truncate_prompt_tokens=2), 0)))
        firsts: dict[str, tuple] = {}
        answers = []
        while len(firsts) < 2:
            msg = ours.recv()
            if msg[0] == "added":
                answers.append(msg)
            elif msg[0] == "outputs":
                for fields in msg[1]:
                    firsts.setdefault(fields[0], fields)
        assert answers == [("added", "kept", True), ("added", "cut", False)]
        assert (firsts["kept"][_PROMPT], firsts["kept"][_PROMPT_IDS]) == (None, [])
        assert (firsts["cut"][_PROMPT], firsts["cut"][_PROMPT_IDS]) == (None, [6, 7])  # (cut: no text spells it)
        ours.send(("stop",))
        while ours.recv()[0] != "stopped":
            pass
    finally:
        process.join(30)
        if process.is_alive():
            process.kill()


def test_the_front_end_keeps_a_prompt_the_core_runs_as_sent_and_takes_another_from_the_first_output() -> None:
    import threading

    from vtcore.engine.capacity import EngineStats
    from vtcore.engine.core_process import CoreClient, _prompt_as_sent, pack_output
    from vtcore.engine.front_end_text import FrontEndText
    from vtcore.engine.request import Request
    from vtcore.outputs import CompletionOutput, RequestMetrics, RequestOutput

    class Engine:
        requests = {"a": Request("a", [5, 6, 7], greedy(2), 64, 0, "hi"), "t": Request("t", [7], greedy(2), 64, 1)}

    assert _prompt_as_sent(Engine, "a", {"prompt": "hi", "prompt_token_ids": [5, 6, 7]})
    assert not _prompt_as_sent(Engine, "t", {"prompt": "hi", "prompt_token_ids": [5, 6, 7]})  # truncated
    assert not _prompt_as_sent(Engine, "a", "hi") and not _prompt_as_sent(Engine, "n", {"prompt_token_ids": [5]})

    class Odd:  # compares by raising (a bad request's prompt must not take the core down)
        def __eq__(self, other: object) -> bool:
            raise ValueError("no truth value")

    assert not _prompt_as_sent(Engine, "a", {"prompt": Odd(), "prompt_token_ids": [5, 6, 7]})
    assert not _prompt_as_sent(Engine, "a", {"prompt": "hi", "prompt_token_ids": [5, Odd(), 7]})
    reader, writer = multiprocessing.Pipe()
    client = object.__new__(CoreClient)
    client._send_lock, client._unanswered = threading.Lock(), collections.defaultdict(collections.deque)
    client._unanswered_lock = threading.Lock()
    client.conn, client.text, client._prompts = reader, FrontEndText(None, []), {}
    client._sender = type("Sink", (), {"send_pickled": lambda self, data: None})()
    sent_ids = [5, 6, 7]
    for rid in ("a", "b"):
        client.send(("add", rid, {"prompt": "hi", "prompt_token_ids": sent_ids}, greedy(2), 0))

    def output(rid: str, announced: set) -> tuple:
        return pack_output(RequestOutput(rid, "core's", [1, 2], None, [CompletionOutput(0, "", [9], None, None)],
                                         False, 0, RequestMetrics(1, 0)), announced)

    writer.send(("added", "a", True))
    writer.send(("added", "b", False))
    writer.send(("outputs", [output("a", {"a"}), output("b", set())], EngineStats(0, 0, 0.0, 0)))
    assert [client.recv()[0] for _ in range(2)] == ["added", "added"] and not client._unanswered
    outs = client.recv()[1]
    assert [(o.prompt, o.prompt_token_ids) for o in outs] == [("hi", [5, 6, 7]), ("core's", [1, 2])]
    assert outs[0].prompt_token_ids is not sent_ids  # (a copy: the caller may reuse its list)


def test_a_bad_request_fails_alone_and_a_caller_that_leaves_aborts_in_the_core(core: AsyncLLM) -> None:
    async def main() -> None:
        with pytest.raises(ValueError, match=r"outside the vocabulary"):
            await _collect(core, "bad", {"prompt_token_ids": [10 ** 6]}, greedy(2))
        early = core.generate(PROMPTS[1], greedy(1000), "early")
        await early.__anext__()
        await early.aclose()  # the abort goes to the core
        ok = await _collect(core, "after", PROMPTS[2], greedy(3))
        assert len(ok[-1].outputs[0].token_ids) == 3
        # the load the core sent with the step that finished "after": "early" is gone, its blocks free
        assert core.stats().num_running == core.stats().num_waiting == 0 and core.stats().kv_cache_usage == 0

    asyncio.run(main())
    assert core.healthy


def test_an_id_reused_after_a_cancel_before_its_answer_harms_no_one(core: AsyncLLM) -> None:
    """A caller that gives up while its add awaits the core's answer, and a new request under the same id:
    each answer reaches its own add, the old request's abort output does not reach the new stream, and the
    engine serves on."""
    async def main() -> None:
        first = asyncio.create_task(_collect(core, "again", PROMPTS[0], greedy(50)))
        await asyncio.sleep(0)  # its add is sent; the core has not answered
        first.cancel()
        with pytest.raises(asyncio.CancelledError):
            await first
        again = await _collect(core, "again", PROMPTS[1], greedy(3))  # its own engine id: no stale output
        assert again[-1].request_id == "again" and again[-1].outputs[0].finish_reason == "length"
        assert len(again[-1].outputs[0].token_ids) == 3
        ok = await _collect(core, "other", PROMPTS[2], greedy(3))
        assert len(ok[-1].outputs[0].token_ids) == 3

    asyncio.run(main())
    assert core.healthy and core.dead is None


def test_an_add_after_a_stop_is_refused() -> None:
    llm = AsyncLLM(**KNOBS, engine_core_process=True)

    async def main() -> None:
        running = asyncio.create_task(_collect(llm, "running", PROMPTS[0], greedy(5000)))
        await asyncio.sleep(0.5)
        llm.core.send(("stop",))  # as shutdown does, with an add right behind it
        with pytest.raises(EngineDeadError, match="shutting down"):
            await _collect(llm, "late", PROMPTS[1], greedy(5))
        assert (await running)[-1].outputs[0].finish_reason == "abort"

    asyncio.run(main())
    llm.shutdown()
    assert llm.engine.process not in multiprocessing.active_children()


def test_a_rejection_that_does_not_unpickle_is_sent_described() -> None:
    from vtcore.engine.core_process import _sendable

    class TwoArgs(ValueError):
        def __init__(self, a: str, b: str) -> None:
            super().__init__(f"{a}/{b}")

    sent = _sendable(TwoArgs("x", "y"))
    assert type(sent) is RuntimeError and str(sent) == "TwoArgs: x/y"
    kept = _sendable(ValueError("plain"))
    assert type(kept) is ValueError


def test_the_server_and_the_openai_client_work_over_the_core(core: AsyncLLM) -> None:
    openai = pytest.importorskip("openai")
    from vtcore.server.app import build_app

    with ServerThread(build_app(core, MODEL, None, MAX_BYTES)) as srv, \
            openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0, timeout=60) as client:
        stream = client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=6, temperature=0, stream=True)
        text = "".join(c.choices[0].text for c in stream)
        one = client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=6, temperature=0)
        assert text == one.choices[0].text and one.usage.completion_tokens == 6
        chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}],
                                              max_tokens=4, temperature=0)
        assert chat.choices[0].message.content is not None and chat.usage.completion_tokens <= 4
        # a JSON number its float does not spell (a LiteralFloat) in a schema crosses to the core, which it ended
        body = b'{"prompt": "Hi", "max_tokens": 3, "response_format": {"type": "json_schema", "json_schema": ' \
               b'{"name": "n", "schema": {"type": "number", "maximum": 6.757192490248578e+161}}}}'
        r = httpx.post(srv.url + "/v1/completions", content=body, headers={"content-type": "application/json"},
                       timeout=60)
        assert r.status_code == 200 and core.healthy, r.text


def test_a_core_that_dies_ends_every_pending_request_and_shutdown_leaves_no_process() -> None:
    llm = AsyncLLM(**KNOBS, engine_core_process=True)

    async def main() -> None:
        gens = [llm.generate(p, greedy(5000), f"x{i}") for i, p in enumerate(PROMPTS)]
        await gens[0].__anext__()
        os.kill(llm.engine.process.pid, signal.SIGSTOP)  # so that no answer comes to the reset sent now
        pending = asyncio.ensure_future(llm.reset_prefix_cache())
        await asyncio.sleep(0.05)
        os.kill(llm.engine.process.pid, signal.SIGKILL)
        with pytest.raises(EngineDeadError, match=r"engine core process exited \(exit code -9\)"):
            await pending
        for gen in gens:
            with pytest.raises(EngineDeadError, match=r"engine core process exited \(exit code -9\)"):
                async for _ in gen:
                    pass
        with pytest.raises(EngineDeadError):
            await _collect(llm, "later", PROMPTS[0], greedy(2))
        with pytest.raises(EngineDeadError):
            await llm.reset_prefix_cache()

    asyncio.run(main())
    assert not llm.healthy
    llm.shutdown()
    assert llm.engine.process not in multiprocessing.active_children()


def test_a_reset_reaches_the_core_between_its_steps(core: AsyncLLM) -> None:
    """``reset_prefix_cache`` is answered in order by the core: the next request recomputes its prefix."""
    prompt = {"prompt_token_ids": list(range(300, 340))}  # two full 16-token blocks to reuse

    async def cached(rid: str) -> int:
        return (await _collect(core, rid, prompt, greedy(2)))[-1].num_cached_tokens

    async def main() -> list[Any]:
        first, hit = await cached("r0"), await cached("r1")
        answers = await asyncio.gather(core.reset_prefix_cache(), core.reset_prefix_cache())
        return [first, hit, answers, await cached("r2"), await cached("r3")]

    first, hit, answers, after, again = asyncio.run(main())
    assert (first, hit, answers, after, again) == (0, 32, [True, True], 0, 32)


def test_a_core_starts_its_tensor_parallel_workers(core: AsyncLLM) -> None:
    """(The core is no daemon: a daemon process may not start processes of its own.)"""
    ranks = AsyncLLM(**KNOBS, engine_core_process=True, tensor_parallel_size=2)
    try:
        got = asyncio.run(_collect(ranks, "tp", PROMPTS[0], greedy(6)))[-1].outputs[0].token_ids
    finally:
        ranks.shutdown()
    assert got == asyncio.run(_collect(core, "one", PROMPTS[0], greedy(6)))[-1].outputs[0].token_ids
    assert ranks.engine.process not in multiprocessing.active_children()


def test_a_core_that_cannot_start_raises_its_error(tmp_path: Any) -> None:
    """... and leaves no process, and no sender thread holding the pipe open."""
    import threading

    before = set(multiprocessing.active_children())
    senders = sum(t.name == "vtcore-sender" for t in threading.enumerate())
    with pytest.raises(Exception, match="config.json"):
        AsyncLLM(str(tmp_path), device="cpu", engine_core_process=True)
    assert set(multiprocessing.active_children()) <= before
    assert sum(t.name == "vtcore-sender" for t in threading.enumerate()) == senders


def test_serve_takes_the_flag() -> None:
    from vtcore.cli.main import build_parser

    assert build_parser().parse_args(["serve"]).engine_core_process is True  # vLLM V1's default too
    assert build_parser().parse_args(["serve", "--no-engine-core-process"]).engine_core_process is False
    bench = build_parser().parse_args(["bench", "--serve", "--no-engine-core-process"])
    assert bench.engine_core_process is False and build_parser().parse_args(["bench"]).engine_core_process is None


def test_sending_never_waits_for_a_reader_and_keeps_the_order() -> None:
    """A message goes out on the sender's own thread when the socket takes it whole, else through the sender
    thread: a message larger than the pipe holds returns at once while no one reads, what is sent after it
    waits behind it (never overtaking it), the reader gets every message in order, and once the thread has
    written everything, messages go out on the caller's thread again."""
    import threading
    import time

    from vtcore.engine.core_process import CoreClient, _Sender, wire

    reader, writer = multiprocessing.Pipe()
    client = object.__new__(CoreClient)  # its sending half, without a core process
    client._send_lock, client._unanswered = threading.Lock(), collections.defaultdict(collections.deque)
    client._unanswered_lock = threading.Lock()
    client._sender = _Sender(writer)
    sender = client._sender
    client.send(("abort", "first"))
    assert sender.queued == 0 and reader.poll(5)  # written by this thread
    big = ("add", "r", {"prompt_token_ids": list(range(300_000))}, SamplingParams(), 0)  # more than a pipe holds
    started = time.monotonic()
    client.send(big)
    client.send(("abort", "r"))
    sender.send_later(("stop",))
    assert time.monotonic() - started < 1.0 and sender.queued == 3  # the rest of big, and the two behind it
    assert [reader.recv() for _ in range(4)] == [("abort", "first"), wire(big), ("abort", "r"), ("stop",)]
    while sender.queued:
        time.sleep(0.01)
    client.send(("abort", "again"))
    assert sender.queued == 0 and reader.recv() == ("abort", "again")

    class Held:  # the sender's socket, whose thread's writes wait for ``release``
        def __init__(self, sock: Any) -> None:
            self.sock, self.release = sock, threading.Event()
            self.send, self.close = sock.send, sock.close

        def sendall(self, data: Any) -> None:
            self.release.wait(5)
            self.sock.sendall(data)

    held = sender.sock = Held(sender.sock)
    sender.send_later(("abort", "held"))
    client.send(("abort", "behind"))  # the pipe has room, but a message waits before it
    assert sender.queued == 2
    held.release.set()
    assert [reader.recv(), reader.recv()] == [("abort", "held"), ("abort", "behind")]
    sender.close(timeout=5)
    assert not sender.thread.is_alive()


def test_a_message_the_sender_thread_cannot_pickle_reaches_the_reader_as_dead_and_fails_later_sends() -> None:
    """A step's outputs pickled by the sender thread that do not pickle must not leave the front end waiting:
    the reader gets ``("dead", error)`` in their place, and every later send raises that error."""
    from vtcore.engine.core_process import _Sender

    reader, writer = multiprocessing.Pipe()
    sender = _Sender(writer)
    sender.send_later(("outputs", [lambda: 0], None))
    assert reader.poll(10)
    kind, error = reader.recv()
    assert kind == "dead" and isinstance(error, RuntimeError) and "could not be pickled" in str(error)
    sender.thread.join(10)
    with pytest.raises(RuntimeError, match="could not be pickled"):
        sender.send(("added", "r"))


def test_a_process_default_socket_timeout_leaves_the_pipe_blocking() -> None:
    """The sender's socket shares the pipe's open file: a timeout would set O_NONBLOCK on both, and the reader's
    ``recv`` on an empty pipe would then raise instead of waiting."""
    import socket

    from vtcore.engine.core_process import _Sender

    reader, writer = multiprocessing.Pipe()
    socket.setdefaulttimeout(5)
    try:
        sender = _Sender(writer)
    finally:
        socket.setdefaulttimeout(None)
    assert os.get_blocking(writer.fileno())
    sender.send(("abort", "r"))
    assert reader.recv() == ("abort", "r")
    sender.close(timeout=5)


def test_the_core_process_ignores_sigint(core: AsyncLLM) -> None:
    """A terminal's Ctrl-C reaches every process of its group: the core keeps serving (the front end stops it)."""
    os.kill(core.engine.process.pid, signal.SIGINT)
    outs = asyncio.run(_collect(core, "after-sigint", PROMPTS[0], greedy(3)))
    assert outs[-1].finished and len(outs[-1].outputs[0].token_ids) == 3 and core.engine.process.is_alive()


def test_an_idle_core_polls_until_a_message_waits_or_the_time_is_up() -> None:
    """``_poll_awhile`` (the idle core's wait before it blocks on the pipe) returns as soon as a message waits,
    and otherwise after its time, not before."""
    import time

    from vtcore.engine.core_process import _poll_awhile

    reader, writer = multiprocessing.Pipe()
    started = time.perf_counter()
    _poll_awhile(reader, 0.05)
    assert 0.05 <= time.perf_counter() - started < 2
    writer.send(("abort", "r"))
    started = time.perf_counter()
    _poll_awhile(reader, 30)
    assert time.perf_counter() - started < 2 and reader.recv() == ("abort", "r")


def test_a_prompt_that_cannot_be_pickled_fails_alone(core: AsyncLLM) -> None:
    """The front end pickles each message on the caller's thread: a prompt the pipe cannot carry fails its
    own ``generate``, and the sender keeps serving everyone else."""
    async def run() -> list:
        with pytest.raises(TypeError):
            await _collect(core, "bad", {"prompt_token_ids": (t for t in [5, 9, 2])}, greedy(3))
        return await _collect(core, "good", PROMPTS[0], greedy(3))

    outs = asyncio.run(run())
    assert outs[-1].finished and len(outs[-1].outputs[0].token_ids) == 3


class _Unloadable:
    """Pickles, and raises where it is unpickled (the core), as a value whose class the core cannot rebuild."""

    def __reduce__(self) -> tuple:
        return _refuse, ("this value does not unpickle",)


def _refuse(why: str) -> None:
    raise TypeError(why)


def test_a_request_that_does_not_unpickle_in_the_core_fails_alone(core: AsyncLLM) -> None:
    """An add whose parameters the core cannot unpickle (a JSON number past 2**53 in a schema did, once) is
    rejected by name, and the core serves the next request: it was the core loop's end, and every request's."""
    async def run() -> list:
        with pytest.raises(TypeError, match="this value does not unpickle"):
            await _collect(core, "bad", PROMPTS[0], greedy(3, extra_args={"x": _Unloadable()}))
        return await _collect(core, "good", PROMPTS[0], greedy(3))

    outs = asyncio.run(run())
    assert outs[-1].finished and len(outs[-1].outputs[0].token_ids) == 3 and core.healthy


def test_outputs_cross_the_pipe_as_tuples_with_every_field_and_the_prompt_once() -> None:
    """The wire form keeps every field of an output (a field added to the output classes and not packed
    would come back missing or shifted), and drops the prompt after a request's first output."""
    import pickle

    from vtcore.engine.core_process import pack_output, unpack_output
    from vtcore.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput

    def output(finished: bool) -> RequestOutput:
        return RequestOutput("r1", "hi there", [5, 6, 7], [None, {6: Logprob(-0.5, 1, "x")}],
                             [CompletionOutput(0, "ab", [1, 2], -1.25, [{1: Logprob(-0.25, 1, "a")}], None, None),
                              CompletionOutput(1, "c", [3], None, None, "stop", "</s>")],
                             finished, 16, RequestMetrics(4, 3))

    announced: set[str] = set()
    first = pack_output(output(False), announced)
    assert all(not attrs.has(type(v)) for v in first), "packed as plain values, not attrs instances"
    assert unpack_output(pickle.loads(pickle.dumps(first))) == output(False)
    later = unpack_output(pack_output(output(True), announced))
    assert (later.prompt, later.prompt_token_ids) == (None, [])
    assert attrs.evolve(later, prompt="hi there", prompt_token_ids=[5, 6, 7]) == output(True)
    again = unpack_output(pack_output(output(False), announced))  # finished: a reused id is announced anew
    assert again.prompt_token_ids == [5, 6, 7]
