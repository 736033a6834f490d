"""The padded decode path (the code CUDA graphs capture) run eagerly on CPU: same tokens as the
unpadded path, padded rows invisible, async == sync on it."""
from __future__ import annotations

import math

import attrs
import pytest

from vtcore import SamplingParams
from vtcore.conformance.harness import build_engine, greedy, mixed_arrivals, run_engine
from vtcore.layers import attention
from vtcore.worker.model_runner import PLACEHOLDER
from vtcore.testing.runner_probes import withhold_override

KNOBS = dict(device="cpu", block_size=4, num_kv_blocks=400, max_num_seqs=8)
causal = attention.causal_attention


def run(eng, arrivals):
    tokens, _ = run_engine(eng, arrivals)
    assert eng.pool.num_free == eng.pool.num_blocks
    return tokens


def _assert_same(got_outs: dict, ref_outs: dict) -> None:
    """Padded and eager completions: the same tokens, logprobs within 1e-5."""
    for rid, ref in ref_outs.items():
        got = got_outs[rid]
        assert got.token_ids == ref.token_ids
        for a, b in zip(got.logprobs, ref.logprobs):
            assert a.keys() == b.keys()
            assert all(math.isclose(a[t].logprob, b[t].logprob, abs_tol=1e-5) for t in a)


def test_graph_sizes_pad_to_the_next_size(tiny_checkpoint) -> None:
    eng = build_engine(tiny_checkpoint[0], "sync", **KNOBS)
    assert eng.runner.graph_sizes == [1, 2, 4, 8]
    assert build_engine(tiny_checkpoint[0], "sync", **{**KNOBS, "max_num_seqs": 20}).runner.graph_sizes == \
        [1, 2, 4, 8, 16, 20]
    assert build_engine(tiny_checkpoint[0], "sync", **KNOBS, enforce_eager=True).runner.graph_sizes == []


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_padded_decode_equals_the_unpadded_path(tiny_checkpoint, mode) -> None:
    """Three requests decode as a batch padded to 4: tokens and logprobs equal the plain eager path."""
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=2)
    prompts = [[5, 9, 2], [7], [3, 3, 8, 1]]
    outs = {}
    for eager in (True, False):
        eng = build_engine(tiny_checkpoint[0], mode, **KNOBS, enforce_eager=eager)
        for i, p in enumerate(prompts):
            eng.add_request(str(i), {"prompt_token_ids": p}, params)
        done = {}
        while eng.has_unfinished_requests():
            for out in eng.step():
                if out.finished:
                    done[out.request_id] = out.outputs[0]
        outs[eager] = done
        assert eng.runner.padded_decode_steps == (0 if eager else 11)
        # the dummy slot is named by every padded row and must never receive a sample
        assert eager or eng.runner.last_sampled_tokens[eng.runner.dummy_slot].item() == PLACEHOLDER
    _assert_same(outs[False], outs[True])


@pytest.mark.parametrize("n", [3, 16])
def test_async_equals_sync_on_the_padded_path(tiny_checkpoint, n) -> None:
    """Late arrivals and uneven lengths: batches of every size pad, and async stays exact."""
    arrivals = mixed_arrivals(n, n, vocab_size=512)
    knobs = {**KNOBS, "max_num_seqs": 16}
    sync = build_engine(tiny_checkpoint[0], "sync", **knobs)
    asyn = build_engine(tiny_checkpoint[0], "async", **knobs)
    assert run(asyn, arrivals) == run(sync, arrivals)
    assert asyn.runner.padded_decode_steps > 0 and sync.runner.padded_decode_steps > 0
    assert asyn.runner.consuming_forwards == asyn.runner.stale_forwards > 0


def test_abc_triple_on_the_padded_path(tiny_checkpoint) -> None:
    from vtcore.errors import DeviceTokenOverrideIgnored

    arrivals = {0: [("a", [3, 1, 4], greedy(10)), ("b", [9, 2], greedy(10)), ("c", [6], greedy(10))]}
    a = run(build_engine(tiny_checkpoint[0], "sync", **KNOBS), arrivals)
    b = build_engine(tiny_checkpoint[0], "async", **KNOBS)
    withhold_override(b.runner)
    with pytest.raises(DeviceTokenOverrideIgnored):
        run(b, arrivals)
    c = build_engine(tiny_checkpoint[0], "async", **KNOBS)
    assert run(c, arrivals) == a and c.runner.padded_decode_steps > 0


def test_step_inputs_are_16_byte_aligned(tiny_checkpoint) -> None:
    """Every staged input section lands 16-byte aligned: Triton specialises kernels on pointer
    alignment, and a section at an odd int64 offset made the prefill kernel recompile mid-run."""
    eng = build_engine(tiny_checkpoint[0], "sync", **KNOBS, enforce_eager=True)
    views = []
    upload = eng.runner.staging.upload

    def spy(staged, dest=None):
        got = upload(staged, dest)
        views.extend(got)
        return got

    eng.runner.staging.upload = spy
    run(eng, {0: [("a", [5, 6, 7], greedy(3)), ("b", [8], greedy(3)), ("c", [1, 2, 3, 4, 5], greedy(3))]})
    assert len(views) > 20 and all(v.data_ptr() % 16 == 0 for v in views if v.numel())


def test_no_collection_while_capturing() -> None:
    """A dead engine's graphs must not be destroyed mid-capture (it invalidates the capture, seen on an
    H200): garbage is collected before, and no collection runs inside."""
    import gc

    from vtcore.worker.decode_graphs import no_collection

    freed = []

    class Node:
        def __del__(self) -> None:
            freed.append(self)

    def garbage() -> None:
        a, b = Node(), Node()
        a.other, b.other = b, a  # a cycle: only the cyclic collector frees it

    garbage()
    with no_collection():
        assert len(freed) == 2 and not gc.isenabled()
        garbage()
    assert gc.isenabled() and len(freed) == 2
    gc.collect()
    assert len(freed) == 4


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_a_lone_prefill_chunk_runs_padded_and_equals_the_unpadded_path(tiny_checkpoint, mode) -> None:
    """Steps that are one prefill chunk alone (a whole prompt, a chunk that samples nothing, the last
    chunk of a prompt cut by max_num_batched_tokens, a prompt past a cached prefix) take the padded
    chunk path: tokens and logprobs equal the eager path's; a prompt past the largest bucket, or a step
    of several requests, stays on the general path. On both paths a prompt's first chunk, and only it,
    attends over its own K/V (``causal_attention``), the chunks after it and past a cached prefix over the
    cache."""
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=2)
    knobs = {**KNOBS, "max_num_batched_tokens": 32, "max_model_len": 96}
    prompts = [[5, 9, 2, 7, 7, 1, 3, 8, 6], list(range(1, 71)), [5, 9, 2, 7, 7, 1, 3, 8, 6, 4, 4]]
    outs, chunk_steps, dense = {}, {}, {}
    for eager in (True, False):
        eng = build_engine(tiny_checkpoint[0], mode, **knobs, enforce_eager=eager)
        calls: list[int] = []
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(attention, "causal_attention", lambda q, *a: calls.append(q.shape[0]) or causal(q, *a))
            done = {}
            for i, p in enumerate(prompts):  # one at a time: every prefill step is alone
                eng.add_request(str(i), {"prompt_token_ids": p}, params)
                while eng.has_unfinished_requests():
                    for out in eng.step():
                        if out.finished:
                            done[out.request_id] = out.outputs[0]
        outs[eager], chunk_steps[eager] = done, eng.runner.padded_chunk_steps
        dense[eager] = sorted(set(calls))  # (each layer's call)
        assert [(g.q, g.from_zero) for g in eng.runner.chunk_graphs] == (
            [] if eager else [(16, True), (16, False), (32, True), (32, False)])
        assert sum(g.steps for g in eng.runner.chunk_graphs if g.from_zero) == (0 if eager else 2)
    # prompt 0: one chunk; prompt 1 (70 tokens, 32 a step): 32, 32, 6; prompt 2 past prompt 0's cached block(s)
    assert chunk_steps == {True: 0, False: 5}
    # from position 0: prompt 0 (9 tokens; padded: 16) and prompt 1's first chunk (32)
    assert dense == {True: [9, 32], False: [16, 32]}
    _assert_same(outs[False], outs[True])


def test_a_step_of_several_prefills_is_not_a_lone_chunk(tiny_checkpoint) -> None:
    eng = build_engine(tiny_checkpoint[0], "sync", **KNOBS)
    run(eng, {0: [("a", [3, 1, 4], greedy(2)), ("b", [9, 2], greedy(2))]})
    assert eng.runner.padded_chunk_steps == 0 and eng.runner.padded_decode_steps == 1


def test_every_padded_row_has_a_context_as_long_as_its_query(tiny_checkpoint) -> None:
    """The attention kernels' contract: a row's context length is at least its query length. A padded
    row whose context was 1 under a query of q > 1 tokens put the causal range at negative positions:
    block-table reads before the table (an illegal address on CUDA for a 2048-token chunk)."""
    eng = build_engine(tiny_checkpoint[0], "sync", **KNOBS, speculative_config={"method": "ngram",
                                                                                "num_speculative_tokens": 3})
    runner, checked = eng.runner, []

    def check(batch, done):
        for graphs in runner._padded:
            if not done and graphs.takes(batch):
                inputs = graphs.prepare(batch)
                ctx = inputs.sections[3]
                assert len(ctx) == inputs.size and min(ctx) >= graphs.q, (graphs.q, ctx)
                checked.append((graphs.q, graphs.chunk, inputs.size > inputs.rows))

    runner.on_submit.append(check)
    run(eng, {0: [("a", [5, 6, 5, 6, 5, 6, 5], greedy(12)), ("b", [1, 2, 3], greedy(12)),
                  ("c", [7, 7, 7], greedy(12))]})
    run(eng, {0: [("d", list(range(1, 20)), greedy(2))]})
    assert {(q, chunk) for q, chunk, _ in checked} >= {(1, False), (4, False), (32, True)}
    assert any(padded for *_, padded in checked)


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_the_decode_layout_equals_the_general_rows_layout(tiny_checkpoint, mode) -> None:
    """``prepare``'s one-token fast path lays out every decode step as the general per-row layout does:
    rows with their token known, in flight (async) or floating over a verify row (n-gram drafts), block
    tables of several widths, padding."""
    seen = []
    for spec in (None, {"method": "ngram", "num_speculative_tokens": 3}):
        eng = build_engine(tiny_checkpoint[0], mode, **KNOBS, speculative_config=spec)
        graphs = eng.runner.decode_graphs

        def check(batch, done, graphs=graphs):
            if not done and graphs.takes(batch):
                fast, general = graphs._prepare_decode(batch), graphs._prepare_rows(batch)
                assert fast == general
                seen.append((PLACEHOLDER in fast.sections[0], any(s.floats for s in batch),
                             fast.size > fast.rows, len({len(s.request.block_ids) for s in batch}) > 1))

        eng.runner.on_submit.append(check)
        run(eng, {0: [("a", [5, 6, 5, 6, 5, 6, 5], greedy(24)), ("b", [1, 2, 3], greedy(20)),
                      ("c", [7, 7, 7], greedy(16))], 3: [("d", list(range(1, 20)), greedy(9))]})
    kinds = [any(column) for column in zip(*seen)]
    assert kinds == [mode == "async", mode == "async", True, True], seen  # (sync settles a verify row at once)


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_the_chunk_layout_equals_the_general_rows_layout(tiny_checkpoint, mode) -> None:
    """``prepare``'s chunk fast path (positions, KV slots and combine as int64 buffers) lays out every lone chunk as
    the general per-row layout does: a whole prompt, a chunk that samples nothing, a last chunk shorter than
    its bucket and starting mid-block (a budget of 18 tokens), a chunk past a cached prefix, a chunk exactly
    its bucket's size."""
    seen = []
    for budget in (16, 18):
        eng = build_engine(tiny_checkpoint[0], mode, **{**KNOBS, "max_num_batched_tokens": budget,
                                                          "max_model_len": 96})

        def check(batch, done, eng=eng):
            graphs = None if done else next((g for g in eng.runner._padded if g.takes(batch)), None)
            if graphs is not None and graphs.chunk:
                fast, general = graphs.prepare(batch), graphs._prepare_rows(batch)
                assert [isinstance(s, memoryview) for s in fast.sections[:5]] == [False, True, True, False, True]
                listed = [s.tolist() if isinstance(s, memoryview) else s for s in fast.sections]
                assert attrs.evolve(fast, sections=listed) == general
                s = batch[0]
                seen.append((s.start % 4 != 0, not s.samples, s.num_tokens < graphs.q, s.start > 0,
                             s.num_tokens == graphs.q))

        eng.runner.on_submit.append(check)
        before = len(seen)
        prefix = list(range(1, 19))  # 18 tokens: four cached blocks of 4 for b
        run(eng, {0: [("a", prefix + [3, 3, 3, 3], greedy(2))]})
        run(eng, {0: [("b", prefix + [5, 6, 7, 8, 9], greedy(2))]})
        assert eng.runner.padded_chunk_steps == len(seen) - before > 0
    assert [any(column) for column in zip(*seen)] == [True] * 5, seen


def test_a_chunk_past_the_counting_table_is_laid_out_as_lists(tiny_checkpoint, monkeypatch) -> None:
    """A chunk whose KV slots (or positions) pass ``COUNTING_MAX`` (a small model's pool of tens of millions of
    slots) takes the per-row layout: the same tokens as a chunk within it."""
    from vtcore.worker import decode_graphs

    outs = {}
    for most in (decode_graphs.COUNTING_MAX, 12):
        monkeypatch.setattr(decode_graphs, "COUNTING_MAX", most)
        eng = build_engine(tiny_checkpoint[0], "sync", **{**KNOBS, "max_num_batched_tokens": 16, "max_model_len": 96})
        kinds = []

        def check(batch, done, eng=eng, kinds=kinds):
            graphs = None if done else next((g for g in eng.runner._padded if g.takes(batch)), None)
            if graphs is not None and graphs.chunk:
                kinds.append(isinstance(graphs.prepare(batch).sections[1], memoryview))

        eng.runner.on_submit.append(check)
        outs[most] = run(eng, {0: [("a", list(range(1, 24)), greedy(3))]})
        assert kinds == [most > 12] * 2  # (the prompt's two 16-token chunks pass 12)
    assert outs[12] == outs[decode_graphs.COUNTING_MAX]


@pytest.mark.parametrize("q, chunk", [(4, False), (16, True)])
def test_the_widest_padded_step_fits_its_upload_buffer(q, chunk) -> None:
    """Every row full (verify: a whole draft, each token sampling), every block-table row as wide as the
    table: the staged sections still fit the persistent buffer the step uploads into."""
    from types import SimpleNamespace

    import torch

    from vtcore.worker.decode_graphs import DecodeGraphs

    bs, max_len = 4, 64
    graphs = DecodeGraphs(lambda *a: None, torch.device("cpu"), bs, max_len, 8, 8, query_len=q,
                          chunk=chunk)
    blocks = list(range(graphs.max_table))
    start = max_len - q

    def row(i: int) -> SimpleNamespace:
        req = SimpleNamespace(token_ids=list(range(start + 1)), block_ids=blocks, mirror_slot=i)
        draft = () if chunk else tuple(range(q - 1))
        return SimpleNamespace(request=req, start=start, num_tokens=q if chunk else 1 + len(draft), draft=draft,
                               samples=True, floats=0)

    inputs = graphs.prepare([row(i) for i in range(graphs.sizes[-1])])
    assert sum(len(s) for s in inputs.sections) <= graphs.buffer.numel()
    assert len(inputs.sections) == graphs.num_sections  # (the runner's sections follow them, uploaded apart)


def test_an_upload_splits_the_graphs_sections_from_the_runners() -> None:
    """A padded step's own sections go into the graphs' persistent buffer, at the offsets its captured views
    read; the sections the runner appends (floating shares, the drafter's) go elsewhere, however long,
    and each section comes back whole."""
    import torch

    from vtcore.worker.staging import Staging

    staging = Staging(2, torch.device("cpu"))
    sections = [[1, 2, 3], [4], [], [5, 6], list(range(100))]
    staged = staging.stage(0, sections, align=1)
    dest = torch.zeros(8, dtype=torch.int64)
    views = staging.upload(staged, dest, into=3)
    assert [v.tolist() for v in views] == sections
    assert dest[:4].tolist() == [1, 2, 3, 4] and dest[4:].tolist() == [0] * 4  # only the first three
    assert all(v.untyped_storage().data_ptr() == dest.untyped_storage().data_ptr() for v in views[:3])
    assert all(v.untyped_storage().data_ptr() != dest.untyped_storage().data_ptr() for v in views[3:])
