"""Greedy float32 CPU decoding of vtcore's Qwen3.5 (dense and MoE) against HF transformers.

Every generated sequence is checked with ``near_tie_violations``: teacher-forced HF logits on
prompt + our tokens; each of our tokens must be HF's argmax or within 1e-4 of its top logit.
Covers prompts longer than the Gated DeltaNet chunk (at the default chunk of 64 and at a chunk of
8), mixed prompt lengths in one batch, chunked prefill across steps, preemption by recompute,
linear value heads equal to / twice the key heads, tied embeddings, and the async engine
against the sync one with mixed arrivals.
"""
from __future__ import annotations

import json
from typing import Any, Callable

import pytest
import torch

from vtcore.conformance.harness import greedy
from vtcore.testing.oracle import random_prompt as rand_prompt
from vtcore import LLM
from vtcore.conformance.harness import build_engine, mixed_arrivals, run_engine
from vtcore.layers.gated_deltanet import GatedDeltaNet
from vtcore.testing.oracle import hf_model, near_tie_violations, save_checkpoint
from vtcore_qwen3_5.plugin import dense_example, moe_example

BLOCK = 4
GEN = 12
EXAMPLES = {"dense": dense_example(), "moe": moe_example()}
FAMILIES = list(EXAMPLES)

#: name -> config overrides (on top of the family's conformance example)
VARIANTS: dict[str, dict[str, Any]] = {
    "base": {},  # 2 linear key heads, 4 value heads (2x)
    "v-eq-k": {"linear_num_key_heads": 4, "linear_num_value_heads": 4},
    "tied": {"tie_word_embeddings": True},
}


def assert_matches_hf(model: torch.nn.Module, prompt: list[int], out: Any, length: int) -> None:
    tokens = out.outputs[0].token_ids
    assert out.finished and out.outputs[0].finish_reason == "length"
    assert len(tokens) == length, f"prompt len {len(prompt)}: got {len(tokens)} tokens, expected {length}"
    assert out.prompt_token_ids == prompt
    bad = near_tie_violations(model, prompt, tokens)
    assert bad == [], f"prompt len {len(prompt)}: (position, ours, HF's, gap) = {bad}"


@torch.no_grad()
def _perturb(model: torch.nn.Module, seed: int) -> None:
    """HF starts zero-centred norms at 0, the gated norm at 1 and dt_bias at 1: move them all,
    so that loading them (and the (1 + w) vs w convention) matters."""
    gen = torch.Generator().manual_seed(seed + 1000)
    for name, p in model.named_parameters():
        if "norm" in name or name.endswith("dt_bias"):
            p.add_(torch.randn(p.shape, generator=gen) * 0.2)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str, str], tuple[str, torch.nn.Module]]:
    """``checkpoint(family, variant) -> (path, HF model)``, built once per module."""
    cache: dict[tuple[str, str], tuple[str, torch.nn.Module]] = {}

    def make(family: str, variant: str = "base") -> tuple[str, torch.nn.Module]:
        if (family, variant) not in cache:
            example = EXAMPLES[family]
            cfg = {**example.hf_config, **VARIANTS[variant]}
            seed = 7 * FAMILIES.index(family) + list(VARIANTS).index(variant)
            model = hf_model(cfg, seed=seed, oracle=example.oracle)
            _perturb(model, seed)
            path = save_checkpoint(model, str(tmp_path_factory.mktemp(f"qwen3_5-{family}-{variant}")))
            saved = json.load(open(f"{path}/config.json"))
            for key, value in VARIANTS[variant].items():
                assert saved[key] == value, f"{key} did not reach config.json"
            cache[family, variant] = path, model
        return cache[family, variant]

    return make


@pytest.fixture
def small_gdn_chunk(monkeypatch: pytest.MonkeyPatch) -> int:
    """GatedDeltaNet prefills in chunks of 8 (class attribute, read at every forward)."""
    monkeypatch.setattr(GatedDeltaNet, "chunk_size", 8)
    return 8


def _record_steps(llm: LLM, monkeypatch: pytest.MonkeyPatch) -> list[list[tuple[int, int]]]:
    """Record (start, num_tokens) of every scheduled request, per step (wraps this runner's submit)."""
    steps: list[list[tuple[int, int]]] = []
    runner = llm.engine.runner
    submit = runner.submit

    def spy(batch: Any) -> Any:
        steps.append([(s.start, s.num_tokens) for s in batch])
        return submit(batch)

    monkeypatch.setattr(runner, "submit", spy)
    return steps


def _llm(path: str, **knobs: Any) -> LLM:
    return LLM(path, **{"device": "cpu", "block_size": BLOCK, "num_kv_blocks": 128, "seed": 0, **knobs})


# ---------------------------------------------------------------------------- long prompts, mixed batches
@pytest.mark.parametrize("family", FAMILIES)
def test_long_prompt_default_chunk(checkpoint, family: str) -> None:
    """A 150-token prompt: two full GDN chunks of 64 plus a partial one, then decode."""
    assert GatedDeltaNet.chunk_size == 64
    path, model = checkpoint(family)
    prompt = rand_prompt(150, seed=150)
    (out,) = _llm(path).generate([{"prompt_token_ids": prompt}], greedy(GEN))
    assert_matches_hf(model, prompt, out, GEN)


@pytest.mark.parametrize("eager", [True, False], ids=["general-step", "padded-chunk"])
def test_chunk_kernel_prefill_on_the_oracle(checkpoint, monkeypatch: pytest.MonkeyPatch, eager: bool) -> None:
    """The Triton chunked rule (CUDA's prefill path) in the interpreter: a 150-token prompt, 64 tokens a
    call (so the state is carried between calls, across a partial chunk), on the HF oracle; on the general
    step, and as a lone chunk padded to the 256-token bucket (its padding must leave the state alone)."""
    from vtcore.kernels.rmsnorm import INTERPRET
    from vtcore.layers import gated_deltanet

    if not INTERPRET:
        pytest.skip("CPU tensors need the Triton interpreter")
    calls = []
    kernel = GatedDeltaNet._chunked_kernel
    monkeypatch.setattr(gated_deltanet, "use_chunk_kernel", lambda x: True)
    monkeypatch.setattr(gated_deltanet, "KERNEL_MAX_TOKENS", 64)
    monkeypatch.setattr(GatedDeltaNet, "_chunked_kernel", lambda self, *a: calls.append(a[0].shape[0]) or kernel(self, *a))
    path, model = checkpoint("dense")
    prompt = rand_prompt(150, seed=150)
    llm = _llm(path, enforce_eager=eager)
    (out,) = llm.generate([{"prompt_token_ids": prompt}], greedy(GEN))
    # every GDN layer's prefill went through the kernel path
    assert calls and all(n == (150 if eager else 256) for n in calls)
    assert llm.engine.runner.padded_chunk_steps == (0 if eager else 1)
    assert_matches_hf(model, prompt, out, GEN)


@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("family", FAMILIES)
def test_mixed_batch_small_chunk(checkpoint, small_gdn_chunk: int, family: str, variant: str) -> None:
    """Mixed prompt lengths (1 token, below / at / above one chunk, several chunks) in one generate call."""
    path, model = checkpoint(family, variant)
    if variant == "tied":
        from safetensors import safe_open

        with safe_open(f"{path}/model.safetensors", "pt") as f:
            assert "lm_head.weight" not in f.keys(), "a tied checkpoint should not store lm_head"
    lengths = [1, 7, 8, 9, 30, 3]
    max_tokens = [GEN, 5, GEN, 1, GEN, 9]
    prompts = [rand_prompt(n, seed=100 + i) for i, n in enumerate(lengths)]
    llm = _llm(path)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], [greedy(m) for m in max_tokens])
    assert [o.prompt_token_ids for o in outs] == prompts, "outputs must come back in input order"
    for prompt, n, out in zip(prompts, max_tokens, outs):
        assert_matches_hf(model, prompt, out, n)
    assert llm.engine.pool.num_free == llm.engine.pool.num_blocks


@pytest.mark.parametrize("family", FAMILIES)
def test_batched_equals_alone(checkpoint, small_gdn_chunk: int, family: str) -> None:
    """Each request's tokens do not depend on its batch neighbours (state slots do not leak)."""
    path, _ = checkpoint(family)
    prompts = [rand_prompt(n, seed=700 + n) for n in (13, 2, 20)]
    llm = _llm(path)
    together = [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in prompts], greedy(GEN))]
    alone = [llm.generate([{"prompt_token_ids": p}], greedy(GEN))[0].outputs[0].token_ids for p in prompts]
    again = [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in prompts], greedy(GEN))]
    assert together == alone == again


# ---------------------------------------------------------------------------- chunked prefill, preemption
@pytest.mark.parametrize("family", FAMILIES)
def test_chunked_prefill_across_steps(checkpoint, small_gdn_chunk: int, family: str,
                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """A 7-token budget: the prompts prefill over several steps, the GDN state carried between them."""
    path, model = checkpoint(family)
    llm = _llm(path, max_num_batched_tokens=7)
    steps = _record_steps(llm, monkeypatch)
    prompts = [rand_prompt(n, seed=300 + n) for n in (23, 3, 12)]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], greedy(GEN))
    for prompt, out in zip(prompts, outs):
        assert_matches_hf(model, prompt, out, GEN)
    assert all(sum(n for _, n in s) <= 7 for s in steps), steps
    assert steps[0] == [(0, 7)], f"the 23-token prompt should take the whole first budget: {steps[:4]}"
    continued = [(start, n) for s in steps for start, n in s if start > 0 and n > 1]
    assert continued, f"no prefill chunk continued a request's state: {steps}"
    assert any(len(s) > 1 for s in steps), "requests should have shared steps"


@pytest.mark.parametrize("budget", [None, 6], ids=["whole-prefill", "chunked"])
@pytest.mark.parametrize("family", FAMILIES)
def test_preemption_recomputes_correctly(checkpoint, small_gdn_chunk: int, family: str, budget: int | None) -> None:
    """Five requests of up to 16 tokens (4 blocks each) share 8 blocks: preemption must happen, and the
    recompute must restart each preempted request's GDN state from zero."""
    path, model = checkpoint(family)
    llm = _llm(path, num_kv_blocks=8, max_model_len=64, max_num_batched_tokens=budget)
    prompts = [rand_prompt(n, seed=400 + i) for i, n in enumerate([6, 5, 7, 4, 9])]
    max_tokens = [10, 11, 9, 12, 7]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], [greedy(m) for m in max_tokens])
    assert llm.engine.scheduler.num_preemptions > 0
    assert len(outs) == len(prompts)
    for prompt, n, out in zip(prompts, max_tokens, outs):
        assert_matches_hf(model, prompt, out, n)
    assert llm.engine.pool.num_free == 8, "every block must be back in the pool"
    assert not llm.engine.has_unfinished_requests()


# ---------------------------------------------------------------------------- async == sync
KNOBS = dict(device="cpu", block_size=4, num_kv_blocks=400, max_num_seqs=32)
#: "tight": a small pool and a 7-token budget, so the async engine also preempts and chunks prefills
POOLS = {"roomy": {}, "tight": {"num_kv_blocks": 24, "max_num_batched_tokens": 7}}


@pytest.mark.parametrize("pool", list(POOLS))
@pytest.mark.parametrize("family", FAMILIES)
def test_async_equals_sync_mixed_arrivals(checkpoint, small_gdn_chunk: int, family: str, pool: str) -> None:
    path, model = checkpoint(family)
    arrivals = mixed_arrivals(10, seed=5 + FAMILIES.index(family), vocab_size=512)
    arrivals.setdefault(3, []).append(("long", rand_prompt(40, seed=40), greedy(GEN)))
    knobs = {**KNOBS, **POOLS[pool]}
    sync = build_engine(path, "sync", **knobs)
    ref, ref_batches = run_engine(sync, arrivals)
    eng = build_engine(path, "async", **knobs)
    assert sync.depth == 1 and eng.depth == 2
    got, batches = run_engine(eng, arrivals)
    assert batches == ref_batches
    assert got == ref and len(got) == 11
    assert eng.runner.consuming_forwards > 0, "the async run should have decoded from device tokens"
    assert eng.pool.num_free == eng.pool.num_blocks and not eng.requests
    if pool == "tight":
        assert eng.scheduler.num_preemptions > 0 and sync.scheduler.num_preemptions > 0
        assert any(n > 1 and start > 0 for batch in batches for _, start, n in batch), "no chunked prefill"
    prompts = {rid: (ids, params) for group in arrivals.values() for rid, ids, params in group}
    for rid, (ids, params) in prompts.items():
        assert len(got[rid]) == params.max_tokens
        if params.temperature == 0:  # the greedy ones against HF as well
            bad = near_tie_violations(model, ids, got[rid])
            assert bad == [], f"{rid}: (position, ours, HF's, gap) = {bad}"


@pytest.mark.parametrize("family", FAMILIES)
def test_padded_decode_path_equals_eager(checkpoint, family: str) -> None:
    """Qwen3.5 decodes on the padded (graph-captured on CUDA) path: Gated DeltaNet reads its state
    slots from device tensors, padded rows use the dummy slot. Tokens equal the eager per-sequence
    path, the HF oracle holds, and the dummy slot is the only state the padding touches."""
    path, model = checkpoint(family)
    arrivals = mixed_arrivals(5, seed=11 + FAMILIES.index(family), vocab_size=512)
    # one-token prompts arriving once others finished: their first step is decode-shaped, on a
    # reused state slot, so it must start from zero state (state_continues False)
    arrivals.setdefault(30, []).extend([("one-a", [7], greedy(6)), ("one-b", [300], greedy(5))])
    runs = {}
    for eager in (True, False):
        eng = build_engine(path, "async", **KNOBS, enforce_eager=eager)
        runs[eager], _ = run_engine(eng, arrivals)
        assert (eng.runner.padded_decode_steps > 0) == (not eager)
    assert runs[False] == runs[True]
    prompts = {rid: ids for group in arrivals.values() for rid, ids, params in group if params.temperature == 0}
    for rid, ids in prompts.items():
        assert near_tie_violations(model, ids, runs[False][rid]) == []


def test_experts_active_fraction_for_the_roofline(checkpoint) -> None:
    """The bench's roofline counts top_k of num_experts expert weights at batch 1, and more of them
    (under uniform routing) as the batch grows."""
    path, _ = checkpoint("moe")
    experts = [m for m in _llm(path).engine.runner.model.modules() if hasattr(m, "active_fraction")]
    assert experts and all(e.top_k == 2 and e.num_experts == 8 for e in experts)
    assert experts[0].active_fraction(1) == pytest.approx(2 / 8)
    assert experts[0].active_fraction(4) == pytest.approx(1 - (6 / 8) ** 4)
