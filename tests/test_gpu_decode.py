"""On a GPU: the Triton kernels run in the engine, decode replays CUDA graphs (batch 1, 3 padded to
4, and 16), and the graphed engine matches the eager one and async matches sync. Skipped without CUDA."""
from __future__ import annotations

import pytest
import torch

from vtcore import LLM, SamplingParams
from vtcore.conformance.harness import build_engine, mixed_arrivals, run_engine
from vtcore.testing.oracle import near_tie_violations

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
KERNELS = ("_gemv_kernel", "_decode_kernel", "_prefill_kernel", "_rms_norm_kernel", "_qk_norm_rope_kernel",
           "_silu_and_mul_kernel")
PARAMS = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)


def prompts(n: int) -> list[dict]:
    g = torch.Generator().manual_seed(n)
    return [{"prompt_token_ids": torch.randint(0, 512, (int(torch.randint(3, 40, (1,), generator=g)),),
                                               generator=g).tolist()} for _ in range(n)]


def test_the_triton_kernels_run(tiny_checkpoint) -> None:
    llm = LLM(tiny_checkpoint[0], device="cuda", dtype="bfloat16", enforce_eager=True, max_num_seqs=4)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        llm.generate(prompts(3), PARAMS)
        torch.cuda.synchronize()
    names = {e.name for e in prof.events()}
    missing = [k for k in KERNELS if not any(k in n for n in names)]
    assert not missing, f"kernels that never ran: {missing}"


@pytest.mark.parametrize("batch", [1, 3, 16])
def test_graphs_replay_and_match_eager_and_the_oracle(tiny_checkpoint, batch) -> None:
    path, hf = tiny_checkpoint
    outs = {}
    for eager in (True, False):
        llm = LLM(path, device="cuda", dtype="float32", enforce_eager=eager, max_num_seqs=16)
        outs[eager] = [o.outputs[0].token_ids for o in llm.generate(prompts(batch), PARAMS)]
        replays = llm.engine.runner.graph_replays
        assert replays == 0 if eager else replays >= 15
    for tokens in outs.values():
        for p, toks in zip(prompts(batch), tokens):
            assert not near_tie_violations(hf, p["prompt_token_ids"], toks)


def test_a_prompt_from_position_0_replays_its_own_chunk_graph_and_a_hit_the_paged_one(tiny_checkpoint) -> None:
    """A prompt's first chunk attends over its own K/V (SDPA) in the from-zero chunk graphs; the same prompt
    with tokens after it, its prefix cached, replays the paged chunk graph; each agrees with the oracle."""
    path, hf = tiny_checkpoint
    llm = LLM(path, device="cuda", dtype="float32", max_num_seqs=4, block_size=16)
    first = torch.randint(0, 512, (40,), generator=torch.Generator().manual_seed(40)).tolist()  # 2 blocks cached
    ps = [first, first + [1, 5, 9, 2, 6]]
    tokens = [llm.generate([{"prompt_token_ids": p}], PARAMS)[0].outputs[0].token_ids for p in ps]
    chunks = llm.engine.runner.chunk_graphs
    assert [sum(g.replays for g in chunks if g.from_zero == z) for z in (True, False)] == [1, 1]
    for p, toks in zip(ps, tokens):
        assert not near_tie_violations(hf, p, toks)


@pytest.mark.parametrize("n", [1, 3, 16])
def test_async_equals_sync_with_graphs(tiny_checkpoint, n) -> None:
    arrivals = mixed_arrivals(n, n, vocab_size=512) if n > 1 else {0: [("solo", [5, 9, 2, 7], SamplingParams(
        temperature=0.9, seed=5, max_tokens=24, ignore_eos=True, logprobs=1))]}
    knobs = dict(device="cuda", dtype="bfloat16", max_num_seqs=16, num_kv_blocks=256)
    sync, asyn = build_engine(tiny_checkpoint[0], "sync", **knobs), build_engine(tiny_checkpoint[0], "async", **knobs)
    assert run_engine(asyn, arrivals)[0] == run_engine(sync, arrivals)[0]
    assert asyn.runner.graph_replays > 0 and asyn.runner.consuming_forwards == asyn.runner.stale_forwards


def test_a_draft_model_replays_its_own_graphs_after_padded_steps(tiny_checkpoint) -> None:
    """The draft model's pass and chains after padded steps replay graphs of their own
    (``vtcore.worker.drafter_graphs``): the target as its own draft (greedy and sampled requests) gives the
    tokens and accepted counts of the same engine with those graphs not captured (the same padded calls,
    eager), and greedy tokens stay within the oracle's near-ties."""
    path, hf = tiny_checkpoint
    arrivals = mixed_arrivals(8, 8, vocab_size=512)
    spec = {"method": "draft_model", "model": path, "num_speculative_tokens": 3}
    runs = {}
    for graphed in (True, False):
        engine = build_engine(path, "async", device="cuda", dtype="float32", max_num_seqs=16, num_kv_blocks=256,
                              speculative_config=spec)
        if not graphed:
            for drafter in engine.runner.drafter_graphs.values():
                drafter.graphs.clear()
                drafter.passes.clear()
        tokens, _ = run_engine(engine, arrivals)
        assert engine.runner.padded_verify_steps > 0
        assert (engine.runner.drafter_graph_replays > 0) == graphed
        stats = engine.spec_stats
        runs[graphed] = (tokens, stats.num_draft_tokens, stats.accepted_per_position)
        for rid, prompt, params in (c for batch in arrivals.values() for c in batch):
            if params.temperature == 0:
                assert not near_tie_violations(hf, prompt, tokens[rid]), (graphed, rid)
    assert runs[True] == runs[False]
    assert runs[True][2][0] > 0  # drafts were accepted


def test_after_the_warm_up_a_mixed_load_compiles_nothing(tiny_checkpoint) -> None:
    """The engine's warm-up (at construction) compiles every Triton variant a mixed load needs: prompts
    alone and beside decoding rows, several at once, decode at padded sizes, sampled and greedy rows."""
    from vtcore.bench.step_stats import count_triton_compiles

    llm = LLM(tiny_checkpoint[0], device="cuda", dtype="bfloat16", max_num_seqs=16)
    with count_triton_compiles() as compiled:
        run_engine(llm.engine, mixed_arrivals(16, 7, vocab_size=512))
    assert compiled == []


def test_after_the_warm_up_constrained_requests_compile_nothing() -> None:
    """The constrained rows' draw (a batch of only constrained rows, and a late draw beside unconstrained
    rows, sync and async) uses the kernel variants the warm-up compiled."""
    from vtcore.bench.step_stats import count_triton_compiles
    from vtcore.config import DEFAULT_MODEL
    from vtcore.sampling_params import StructuredOutputsParams

    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
    constrained = SamplingParams(temperature=0.0, max_tokens=12,
                                 structured_outputs=StructuredOutputsParams(json=schema))
    free = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    for async_scheduling in (False, True):
        llm = LLM(DEFAULT_MODEL, device="cuda", dtype="bfloat16", max_num_seqs=8, async_scheduling=async_scheduling)
        llm.engine.compile_grammar(constrained.structured_outputs)  # (xgrammar's compile: not Triton)
        with count_triton_compiles() as compiled:
            llm.generate(["A", "B"], constrained, use_tqdm=False)
            llm.generate(["A", "B", "C"], [constrained, free, constrained], use_tqdm=False)
        assert compiled == []
