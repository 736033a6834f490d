"""The async engine (depth-2 batch queue, device mirror) against the sync engine in the same process."""
from __future__ import annotations

import asyncio
import importlib.metadata as md
import json
import os
import shutil

import pytest

from vtcore import LLM, AsyncLLM, SamplingParams
from vtcore.conformance.harness import build_engine, greedy, mixed_arrivals, run_engine
from vtcore.errors import DeviceTokenOverrideIgnored, EngineDeadError, VtcoreError
from vtcore.plugins.manager import Plugins, reset_plugins
from vtcore.sampling_params import RequestOutputKind
from vtcore.worker.model_runner import PLACEHOLDER
from vtcore.testing.runner_probes import withhold_override

KNOBS = dict(device="cpu", block_size=4, num_kv_blocks=400, max_num_seqs=32)


def engine(path: str, mode: str, **knobs):
    """mode: 'sync', 'async' (mirror on) or 'mirror-off' (async front, host waits)."""
    eng = build_engine(path, mode, **{**KNOBS, **knobs})
    assert eng.depth == (2 if mode == "async" else 1)
    return eng


def run(eng, arrivals):
    tokens, batches = run_engine(eng, arrivals)
    assert eng.pool.num_free == eng.pool.num_blocks and not eng.requests
    return tokens, batches


def mixed(n: int, seed: int):
    return mixed_arrivals(n, seed, vocab_size=512)


@pytest.mark.parametrize("mode", ["async", "mirror-off"])
def test_batch_one_five_times(tiny_checkpoint, mode) -> None:
    ref, ref_batches = run(engine(tiny_checkpoint[0], "sync"), {0: [("a", [7, 3, 9], greedy(24))]})
    eng = engine(tiny_checkpoint[0], mode)
    for _ in range(5):
        got, batches = run(eng, {0: [("a", [7, 3, 9], greedy(24))]})
        assert got == ref and batches == ref_batches


@pytest.mark.parametrize("mode", ["async", "mirror-off"])
@pytest.mark.parametrize("n", [4, 16])
def test_concurrency_brackets_with_late_arrivals(tiny_checkpoint, mode, n) -> None:
    ref, ref_batches = run(engine(tiny_checkpoint[0], "sync"), mixed(n, n))
    got, batches = run(engine(tiny_checkpoint[0], mode), mixed(n, n))
    assert batches == ref_batches
    assert got == ref and len(got) == n


def test_max_tokens_bracket(tiny_checkpoint) -> None:
    lengths = [*range(1, 9), 16, 33, 64, 128]
    arrivals = {0: [(f"m{n}", [n, n + 1, 5], greedy(n)) for n in lengths]}
    ref, ref_batches = run(engine(tiny_checkpoint[0], "sync", max_model_len=256), arrivals)
    got, batches = run(engine(tiny_checkpoint[0], "async", max_model_len=256), arrivals)
    assert got == ref and batches == ref_batches
    assert {rid: len(t) for rid, t in got.items()} == {f"m{n}": n for n in lengths}


def test_abort_mid_stream_leaves_the_others_exact(tiny_checkpoint) -> None:
    arrivals = {0: [(f"k{i}", [i + 1, 2 * i + 3], greedy(20)) for i in range(4)]}
    ref, _ = run(engine(tiny_checkpoint[0], "sync"), arrivals)
    eng = engine(tiny_checkpoint[0], "async")
    for rid, ids, params in arrivals[0]:
        eng.add_request(rid, {"prompt_token_ids": ids}, params)
    final = {}
    for call in range(200):
        if call == 6:
            eng.abort_request("k1")
        for out in eng.step():
            if out.finished:
                final[out.request_id] = out.outputs[0]
        if not eng.has_unfinished_requests():
            break
    assert final["k1"].finish_reason == "abort" and len(final["k1"].token_ids) < 20
    assert {r: final[r].token_ids for r in ("k0", "k2", "k3")} == {r: ref[r] for r in ("k0", "k2", "k3")}
    assert eng.pool.num_free == eng.pool.num_blocks and not eng.requests


def test_eos_stop_drops_the_extra_step(make_checkpoint) -> None:
    """A stop that needs the token's value leaves one step in flight, whose token is dropped."""
    path, _ = make_checkpoint()
    ref_eng = engine(path, "sync")
    probe = run(ref_eng, {0: [("p", [11, 12], greedy(12))]})[0]["p"]
    params = SamplingParams(temperature=0, max_tokens=12, stop_token_ids=[probe[5]])
    ref, _ = run(engine(path, "sync"), {0: [("p", [11, 12], params)]})
    got, _ = run(engine(path, "async"), {0: [("p", [11, 12], params)]})
    assert got == ref and got["p"][-1] == probe[5] and len(got["p"]) == probe.index(probe[5]) + 1


def test_overlap_is_real(tiny_checkpoint) -> None:
    eng = engine(tiny_checkpoint[0], "async")
    staged: list[list[int]] = []
    stage = eng.runner.staging.stage

    def spy(step, sections, **kwargs):
        staged.append(list(sections[0]))  # the host input ids of the step
        return stage(step, sections, **kwargs)

    eng.runner.staging.stage = spy
    eng.event_log = []
    run(eng, {0: [("a", [5, 6, 7], greedy(10)), ("b", [8], greedy(10))]})
    log = eng.event_log
    decode_steps = range(1, len(staged))
    for n in decode_steps:  # schedule(N+1) and prepare(N+1) come before wait(N)
        assert log.index(("schedule", n)) < log.index(("wait", n - 1))
        assert log.index(("prepare", n)) < log.index(("wait", n - 1))
        assert all(t == PLACEHOLDER for t in staged[n]), staged[n]  # decode rows carry the placeholder
    assert eng.runner.consuming_forwards == len(decode_steps)


def test_abc_triple_on_qwen3(tiny_checkpoint) -> None:
    arrivals = {0: [("a", [3, 1, 4, 1, 5], greedy(16)), ("b", [9, 2, 6], greedy(16))]}
    a, _ = run(engine(tiny_checkpoint[0], "sync"), arrivals)
    b = engine(tiny_checkpoint[0], "async")
    withhold_override(b.runner)
    with pytest.raises(DeviceTokenOverrideIgnored, match="qwen3_dense"):
        run(b, arrivals)
    c = engine(tiny_checkpoint[0], "async")
    got, batches = run(c, arrivals)
    assert got == a
    assert c.runner.consuming_forwards == sum(1 for _ in batches) - 1  # every decode step consumed


@pytest.fixture
def fixture_families(monkeypatch):
    monkeypatch.syspath_prepend(os.path.dirname(os.path.dirname(__file__)))
    eps = [*md.entry_points(group="vtcore"),
           md.EntryPoint(name="fixture_async", value="tests.fixture_async.families", group="vtcore")]
    reset_plugins(Plugins(entry_points=eps))
    yield
    reset_plugins(None)


def _as_arch(src: str, dst: str, arch: str) -> str:
    shutil.copytree(src, dst)
    with open(os.path.join(dst, "config.json")) as f:
        cfg = json.load(f)
    cfg["architectures"] = [arch]
    with open(os.path.join(dst, "config.json"), "w") as f:
        json.dump(cfg, f)
    return dst


def test_a_model_that_ignores_the_override_fails(tiny_checkpoint, fixture_families, tmp_path) -> None:
    path = _as_arch(tiny_checkpoint[0], str(tmp_path / "m"), "IgnoresOverrideForCausalLM")
    eng = engine(path, "async")
    with pytest.raises(IndexError):  # it embeds the host placeholder -1
        run(eng, {0: [("a", [3, 1, 4], greedy(8))]})


def test_undeclared_family_is_refused_async_by_name(tiny_checkpoint, fixture_families, tmp_path) -> None:
    path = _as_arch(tiny_checkpoint[0], str(tmp_path / "u"), "UndeclaredForCausalLM")
    with pytest.raises(VtcoreError, match="'undeclared'.*consumes device token ids"):
        LLM(path, device="cpu", async_scheduling=True)
    assert LLM(path, device="cpu").engine.depth == 1  # the default turns async off for it


def test_mirror_variable_is_validated(tiny_checkpoint, monkeypatch) -> None:
    monkeypatch.setenv("VTCORE_ASYNC_DEVICE_MIRROR", "yes")
    with pytest.raises(ValueError, match="VTCORE_ASYNC_DEVICE_MIRROR='yes'"):
        LLM(tiny_checkpoint[0], device="cpu")


# ---------------------------------------------------------------------- AsyncLLM
@pytest.fixture
def async_llm(tiny_checkpoint):
    llm = AsyncLLM(tiny_checkpoint[0], **KNOBS)
    yield llm
    llm.shutdown()


async def _collect(llm, rid, ids, params):
    return [o async for o in llm.generate({"prompt_token_ids": ids}, params, rid)]


@pytest.mark.parametrize("kind", [RequestOutputKind.DELTA, RequestOutputKind.CUMULATIVE])
def test_a_consumer_that_falls_behind_takes_one_output_with_every_token_since(async_llm, kind) -> None:
    """vLLM's output collector: outputs the caller has not taken merge (deltas appended, cumulative states
    replaced), so a stream read late gets one output, and its tokens, text and logprobs are the stream's."""
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=1, output_kind=kind)

    async def main():
        whole = [o async for o in async_llm.generate({"prompt_token_ids": [5, 6, 7]}, params, "whole")]
        late = async_llm.generate({"prompt_token_ids": [5, 6, 7]}, params, "late")
        first = await late.__anext__()
        (pending,) = [p for _, p in async_llm._streams.values()]
        for _ in range(3000):  # the engine runs the request to its end (handed over) while nothing is taken
            if pending.item is not None and pending.item.finished:
                break
            await asyncio.sleep(0.002)
        rest = [o async for o in late]
        return whole, first, rest

    whole, first, rest = asyncio.run(main())
    assert len(rest) == 1 and rest[0].finished and len(whole) > 2
    if kind == RequestOutputKind.DELTA:
        def joined(outs, field):
            parts = [getattr(o.outputs[0], field) for o in outs]
            return "".join(parts) if field == "text" else [x for part in parts for x in part]
        for field in ("token_ids", "text", "logprobs"):
            assert joined([first, *rest], field) == joined(whole, field), field
    else:
        assert rest[0].outputs[0].token_ids == whole[-1].outputs[0].token_ids and len(rest[0].outputs) == 1
    assert rest[0].outputs[0].finish_reason == "length" and rest[0].outputs[0].cumulative_logprob == pytest.approx(
        whole[-1].outputs[0].cumulative_logprob)


def test_merged_outputs_of_several_samples_keep_each_samples_own_tokens() -> None:
    """``RequestOutput.add`` of an ``n > 1`` stream: each delta joins its own sample (by ``index``); a sample new
    to the output is added; the request's state, and its prompt logprobs where it has them, are the later one's."""
    from vtcore.outputs import CompletionOutput, RequestMetrics, RequestOutput

    def out(parts, finished=False, plp=None, drafts=0):
        ends = "length" if finished else None
        completions = [CompletionOutput(i, t, ids, None, None, ends) for i, t, ids in parts]
        return RequestOutput("r", None, [1], plp, completions, finished, 0, RequestMetrics(drafts, 0))

    merged = out([(1, "b", [2])], plp=[None])
    merged.add(out([(0, "x", [9]), (1, "c", [3])], drafts=4), aggregate=True)
    merged.add(out([(1, "d", [4])], finished=True, plp=[{}]), aggregate=True)
    assert [(c.index, c.text, c.token_ids, c.finish_reason) for c in merged.outputs] == [
        (1, "bcd", [2, 3, 4], "length"), (0, "x", [9], None)]
    assert merged.finished and merged.prompt_logprobs == [{}] and merged.metrics.num_draft_tokens == 0
    cumulative = out([(0, "a", [1])], plp=[None])  # (a chunked prompt's logprobs so far)
    cumulative.add(out([(0, "ab", [1, 2])], plp=[None, {}]), aggregate=False)
    cumulative.add(out([(0, "abc", [1, 2, 3])]), aggregate=False)
    assert [(c.text, c.token_ids) for c in cumulative.outputs] == [("abc", [1, 2, 3])]
    assert cumulative.prompt_logprobs == [None, {}]


def test_an_in_process_engine_loop_caps_its_wait_for_the_gil(tiny_checkpoint, monkeypatch) -> None:
    """The engine thread shares the GIL with the caller's event loop: AsyncLLM lowers the switch interval
    (vtcore.engine.gil), and keeps one already shorter."""
    import sys

    from vtcore.engine.gil import ENGINE_SWITCH_INTERVAL_S

    before = sys.getswitchinterval()
    try:
        shorter = ENGINE_SWITCH_INTERVAL_S / 2
        for start, want in ((5e-3, ENGINE_SWITCH_INTERVAL_S), (shorter, shorter)):
            sys.setswitchinterval(start)
            llm = AsyncLLM(tiny_checkpoint[0], **KNOBS)
            llm.shutdown()
            assert sys.getswitchinterval() == pytest.approx(want)
    finally:
        sys.setswitchinterval(before)


def test_async_llm_streams_and_equals_offline(tiny_checkpoint, async_llm) -> None:
    prompts = [[i + 1, 2 * i + 5, 7] for i in range(6)]

    async def main():
        return await asyncio.gather(*[_collect(async_llm, f"s{i}", p, greedy(10 + i)) for i, p in enumerate(prompts)])

    streams = asyncio.run(main())
    offline = LLM(tiny_checkpoint[0], **KNOBS).generate([{"prompt_token_ids": p} for p in prompts],
                                                        [greedy(10 + i) for i in range(6)])
    for stream, ref in zip(streams, offline):
        assert stream[-1].finished and not any(o.finished for o in stream[:-1])
        lengths = [len(o.outputs[0].token_ids) for o in stream]
        assert lengths == sorted(lengths)  # cumulative
        assert stream[-1].outputs[0].token_ids == ref.outputs[0].token_ids


def test_a_step_wakes_the_event_loop_once_for_all_its_requests(async_llm) -> None:
    """The engine thread hands a step's outputs over in one call per event loop, not one per request."""
    prompts = [[i + 1, 3, 9] for i in range(8)]
    steps0 = async_llm.engine.runner.steps_submitted

    async def main():
        loop = asyncio.get_running_loop()
        real, calls = loop.call_soon_threadsafe, []

        def counting(*args):
            calls.append(args)
            return real(*args)

        loop.call_soon_threadsafe = counting
        outs = await asyncio.gather(*[_collect(async_llm, f"w{i}", p, greedy(12)) for i, p in enumerate(prompts)])
        return outs, len(calls)

    streams, wakeups = asyncio.run(main())
    steps = async_llm.engine.runner.steps_submitted - steps0
    assert all(len(s[-1].outputs[0].token_ids) == 12 for s in streams)
    assert sum(len(s) for s in streams) >= 8 * 6  # outputs streamed step by step, not only at the end
    assert wakeups <= steps + len(prompts)  # one a step, and one per add (its future): not one a request a step


def test_async_llm_deltas_abort_and_duplicates(async_llm) -> None:
    async def main():
        delta = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, output_kind=RequestOutputKind.DELTA)
        outs = await _collect(async_llm, "d", [4, 5], delta)
        full = await _collect(async_llm, "f", [4, 5], greedy(12))
        assert sum((o.outputs[0].token_ids for o in outs), []) == full[-1].outputs[0].token_ids
        gen = async_llm.generate({"prompt_token_ids": [1, 2]}, greedy(100), "dup")
        first = await gen.__anext__()
        with pytest.raises(ValueError, match="'dup'"):
            await _collect(async_llm, "dup", [3], greedy(2))
        await async_llm.abort("dup")
        rest = [o async for o in gen]
        assert rest[-1].outputs[0].finish_reason == "abort" and first is not None
        with pytest.raises(ValueError, match="outside the vocabulary"):
            await _collect(async_llm, "bad", [10 ** 6], greedy(2))
        ok = await _collect(async_llm, "after", [1], greedy(3))  # a bad request fails alone
        assert len(ok[-1].outputs[0].token_ids) == 3
        # A consumer that leaves early aborts its request and frees its blocks.
        early = async_llm.generate({"prompt_token_ids": [1, 2]}, greedy(100), "early")
        await early.__anext__()
        await early.aclose()
        for _ in range(100):
            await asyncio.sleep(0.01)
            if not async_llm.engine.requests:
                break
        assert async_llm.engine.pool.num_free == async_llm.engine.pool.num_blocks

    asyncio.run(main())


def test_a_caller_that_leaves_before_its_request_is_added_harms_no_one(async_llm, monkeypatch) -> None:
    """A generate() cancelled while its request still waits in the inbox (an HTTP client that gave up
    while the engine was busy): the request is never added, and the engine serves on. This once
    killed the engine loop (setting the result of the cancelled future raised)."""
    import threading

    gate = threading.Event()
    drain = async_llm._drain_inbox
    monkeypatch.setattr(async_llm, "_drain_inbox", lambda: (gate.wait(), drain()))

    async def main():
        victim = asyncio.create_task(_collect(async_llm, "victim", [1, 2], greedy(50)))
        for _ in range(20):
            await asyncio.sleep(0)  # generate() is awaiting its add, which the engine thread holds back
        victim.cancel()
        with pytest.raises(asyncio.CancelledError):
            await victim
        gate.set()
        ok = await _collect(async_llm, "after", [1], greedy(3))
        assert len(ok[-1].outputs[0].token_ids) == 3 and async_llm.dead is None
        assert not async_llm.engine.requests  # the victim was never added (it would still run)

    asyncio.run(main())


def test_an_id_reused_while_its_aborted_request_is_still_in_the_engine_gets_only_its_own_outputs(async_llm) -> None:
    """A caller that left a running request and reuses its id at once: the engine has not reported the
    abort yet when the new request arrives. The new request is added and streams its own tokens; the old
    one's abort output reaches no one (under one engine id it was refused, or ended the new stream)."""
    async def main():
        first = async_llm.generate({"prompt_token_ids": [1, 2]}, greedy(100), "again")
        await first.__anext__()
        await first.aclose()  # the abort waits in the inbox
        again = await _collect(async_llm, "again", [3], greedy(4))
        assert [o.request_id for o in again] == ["again"] * len(again)
        assert again[-1].outputs[0].finish_reason == "length" and len(again[-1].outputs[0].token_ids) == 4
        assert (await _collect(async_llm, "again", [3], greedy(4)))[-1] == again[-1]  # greedy: the same tokens again
        with pytest.raises(ValueError, match=r"^request 'again': the prompt is empty"):  # the caller's id
            await _collect(async_llm, "again", [], greedy(4))

    asyncio.run(main())


def test_engine_death_reaches_every_pending_request(async_llm) -> None:
    def boom():
        raise RuntimeError("kaboom")

    async def main():
        gens = [async_llm.generate({"prompt_token_ids": [1, 2]}, greedy(50), f"x{i}") for i in range(3)]
        await gens[0].__anext__()
        async_llm.engine.step = boom
        for gen in gens:
            with pytest.raises(EngineDeadError, match="kaboom"):
                async for _ in gen:
                    pass
        with pytest.raises(EngineDeadError):
            await _collect(async_llm, "later", [1], greedy(2))

    asyncio.run(main())


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_prompt_logprobs_only_request_runs_every_prefill_chunk(tiny_checkpoint, mode) -> None:
    """max_tokens=0 with prompt_logprobs must not leave the scheduler before its last prefill chunk."""
    eng = engine(tiny_checkpoint[0], mode, max_num_batched_tokens=7)
    eng.add_request("p", {"prompt_token_ids": list(range(1, 26))}, SamplingParams(max_tokens=0, prompt_logprobs=1))
    outs = [o for _ in range(50) if eng.has_unfinished_requests() for o in eng.step()]
    final = [o for o in outs if o.finished]
    assert len(final) == 1 and final[0].outputs[0].token_ids == []
    assert len(final[0].prompt_logprobs) == 25 and final[0].prompt_logprobs[0] is None
    assert eng.pool.num_free == eng.pool.num_blocks and not eng.requests


def test_a_stop_with_a_step_in_flight_is_reported_once(tiny_checkpoint) -> None:
    eng = engine(tiny_checkpoint[0], "async")
    probe = run(engine(tiny_checkpoint[0], "sync"), {0: [("p", [11, 12], greedy(6))]})[0]["p"]
    eng.add_request("p", {"prompt_token_ids": [11, 12]}, SamplingParams(temperature=0, max_tokens=6,
                                                                          stop_token_ids=[probe[2]]))
    finished = [o for _ in range(30) if eng.has_unfinished_requests() for o in eng.step() if o.finished]
    assert len(finished) == 1 and finished[0].outputs[0].token_ids[-1] == probe[2]
