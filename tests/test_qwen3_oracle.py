"""Greedy float32 CPU decoding of vtcore's Qwen3 against HF transformers (the near-tie rule).

Every generated sequence is checked with ``near_tie_violations``: teacher-forced HF logits on
prompt + our tokens; each of our tokens must be HF's argmax or within 1e-4 of its top logit.
Covers tied / untied embeddings, GQA ratios 1, 2, 3 and 4, attention biases (and non-trivial
norm weights), prompts around block boundaries, mixed batches, chunked prefill, preemption by
recompute, and ``load_format="dummy"``.
"""
from __future__ import annotations

import json
import random
from typing import Any, Callable

import pytest
import torch

from vtcore.testing.oracle import tiny_config
from vtcore import LLM, SamplingParams
from vtcore.testing.oracle import hf_model, near_tie_violations, save_checkpoint

BLOCK = 4
GEN = 8  # generated tokens per request: crosses at least one more block boundary

#: name -> (config overrides, perturb norms/biases before saving)
CONFIGS: dict[str, tuple[dict[str, Any], bool]] = {
    "untied-gqa2": ({}, False),
    "tied-mha": ({"tie_word_embeddings": True, "num_key_value_heads": 4}, False),
    "untied-gqa3-bias": ({"num_attention_heads": 6, "num_key_value_heads": 2, "attention_bias": True}, True),
    "tied-gqa4-bias": ({"tie_word_embeddings": True, "num_attention_heads": 4, "num_key_value_heads": 1,
                        "attention_bias": True}, True),
}


def greedy(max_tokens: int = GEN, **kw: Any) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, **kw)


def rand_prompt(n: int, seed: int, vocab: int = 512) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(vocab) for _ in range(n)]


def assert_matches_hf(model: torch.nn.Module, prompt: list[int], out: Any, length: int) -> None:
    tokens = out.outputs[0].token_ids
    assert len(tokens) == length, f"prompt len {len(prompt)}: got {len(tokens)} tokens, expected {length}"
    assert out.outputs[0].finish_reason == "length"
    assert out.prompt_token_ids == prompt
    bad = near_tie_violations(model, prompt, tokens)
    assert bad == [], f"prompt len {len(prompt)}: (position, ours, HF's, gap) = {bad}"


@torch.no_grad()
def _perturb(model: torch.nn.Module, seed: int) -> None:
    """HF initialises biases to 0 and norm weights to 1: make both non-trivial so loading them matters."""
    gen = torch.Generator().manual_seed(seed + 1000)
    for name, p in model.named_parameters():
        if name.endswith(".bias"):
            p.copy_(torch.randn(p.shape, generator=gen) * 0.1)
        elif "norm" in name:
            p.copy_(1.0 + torch.randn(p.shape, generator=gen) * 0.2)


@pytest.fixture(scope="module", params=list(CONFIGS))
def variant(request: pytest.FixtureRequest, make_checkpoint: Callable[..., tuple[str, Any]],
            tmp_path_factory: pytest.TempPathFactory) -> tuple[str, LLM, torch.nn.Module]:
    """(name, LLM, HF model) for each tiny config, one LLM per config."""
    name = request.param
    overrides, perturb = CONFIGS[name]
    if perturb:
        model = hf_model(tiny_config(**overrides), seed=3)
        _perturb(model, seed=3)
        path = save_checkpoint(model, str(tmp_path_factory.mktemp(f"ckpt-{name}")))
    else:
        path, model = make_checkpoint(seed=1, **overrides)
    cfg = json.load(open(f"{path}/config.json"))
    for key, value in overrides.items():
        assert cfg[key] == value, f"{key} did not reach config.json"
    llm = LLM(path, device="cpu", block_size=BLOCK, num_kv_blocks=64, max_model_len=128, seed=0)
    return name, llm, model


@pytest.mark.parametrize("prompt_len", [1, BLOCK - 1, BLOCK, BLOCK + 1, 3 * BLOCK + 2])
def test_prompt_lengths_match_hf(variant: tuple[str, LLM, torch.nn.Module], prompt_len: int) -> None:
    _, llm, model = variant
    prompt = rand_prompt(prompt_len, seed=prompt_len)
    (out,) = llm.generate([{"prompt_token_ids": prompt}], greedy())
    assert_matches_hf(model, prompt, out, GEN)


def test_mixed_batch_matches_hf(variant: tuple[str, LLM, torch.nn.Module]) -> None:
    _, llm, model = variant
    lengths = [9, 1, 4, 17, 3, 5, 8]
    prompts = [rand_prompt(n, seed=100 + i) for i, n in enumerate(lengths)]
    max_tokens = [GEN, 3, GEN + 2, 1, GEN, 5, 6]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], [greedy(m) for m in max_tokens])
    assert [o.prompt_token_ids for o in outs] == prompts, "outputs must come back in input order"
    for prompt, n, out in zip(prompts, max_tokens, outs):
        assert_matches_hf(model, prompt, out, n)
    assert llm.engine.pool.num_free == llm.engine.pool.num_blocks, "finished requests must free their blocks"


@pytest.mark.parametrize("prompt_len", [1, 7, 8, 9, 20])
def test_block_size_8(tiny_checkpoint: tuple[str, Any], prompt_len: int, llm8: LLM) -> None:
    _, model = tiny_checkpoint
    prompt = rand_prompt(prompt_len, seed=200 + prompt_len)
    (out,) = llm8.generate([{"prompt_token_ids": prompt}], greedy(10))
    assert_matches_hf(model, prompt, out, 10)


@pytest.fixture(scope="module")
def llm8(tiny_checkpoint: tuple[str, Any]) -> LLM:
    return LLM(tiny_checkpoint[0], device="cpu", block_size=8, num_kv_blocks=32, max_model_len=128)


def _record_steps(llm: LLM, monkeypatch: pytest.MonkeyPatch) -> list[list[int]]:
    """Record the tokens each scheduled request computes per step (wraps the runner on this instance)."""
    steps: list[list[int]] = []
    runner = llm.engine.runner
    submit = runner.submit

    def spy(batch: Any) -> Any:
        steps.append([s.num_tokens for s in batch])
        return submit(batch)

    monkeypatch.setattr(runner, "submit", spy)
    return steps


def test_chunked_prefill_matches_hf(tiny_checkpoint: tuple[str, Any], monkeypatch: pytest.MonkeyPatch) -> None:
    path, model = tiny_checkpoint
    llm = LLM(path, device="cpu", block_size=BLOCK, num_kv_blocks=64, max_model_len=128, max_num_batched_tokens=5)
    steps = _record_steps(llm, monkeypatch)
    prompt = rand_prompt(23, seed=23)
    (out,) = llm.generate([{"prompt_token_ids": prompt}], greedy(GEN))
    assert_matches_hf(model, prompt, out, GEN)
    assert all(sum(s) <= 5 for s in steps), steps
    assert steps[:5] == [[5], [5], [5], [5], [3]], f"the 23-token prompt should prefill in chunks of 5: {steps}"


def test_chunked_prefill_batch_matches_hf(tiny_checkpoint: tuple[str, Any], monkeypatch: pytest.MonkeyPatch) -> None:
    """Several prompts share a 5-token budget: chunks of different requests mix with decodes."""
    path, model = tiny_checkpoint
    llm = LLM(path, device="cpu", block_size=BLOCK, num_kv_blocks=64, max_model_len=128, max_num_batched_tokens=5)
    steps = _record_steps(llm, monkeypatch)
    prompts = [rand_prompt(n, seed=300 + n) for n in (23, 2, 11, 6)]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], greedy(GEN))
    for prompt, out in zip(prompts, outs):
        assert_matches_hf(model, prompt, out, GEN)
    assert all(sum(s) <= 5 for s in steps)
    assert any(len(s) > 1 for s in steps), "requests should have shared steps"


@pytest.mark.parametrize("budget", [None, 6], ids=["whole-prefill", "chunked"])
def test_preemption_recomputes_correctly(tiny_checkpoint: tuple[str, Any], budget: int | None) -> None:
    """Five requests of up to 16 tokens (4 blocks each) share 8 blocks: preemption must happen."""
    path, model = tiny_checkpoint
    llm = LLM(path, device="cpu", block_size=BLOCK, num_kv_blocks=8, max_model_len=64, max_num_batched_tokens=budget)
    prompts = [rand_prompt(n, seed=400 + i) for i, n in enumerate([6, 5, 7, 4, 6])]
    max_tokens = [10, 11, 9, 12, 10]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], [greedy(m) for m in max_tokens])
    assert llm.engine.scheduler.num_preemptions > 0
    assert len(outs) == len(prompts)
    for prompt, n, out in zip(prompts, max_tokens, outs):
        assert out.finished
        assert_matches_hf(model, prompt, out, n)
    assert llm.engine.pool.num_free == 8, "every block must be back in the pool"
    assert not llm.engine.has_unfinished_requests()


def test_preemption_matches_unpreempted_run(tiny_checkpoint: tuple[str, Any]) -> None:
    """The same batch with a roomy pool gives the same tokens as the preempting one."""
    path, _ = tiny_checkpoint
    prompts = [{"prompt_token_ids": rand_prompt(n, seed=500 + n)} for n in (3, 9, 6, 5)]
    runs = []
    for blocks in (64, 6):
        llm = LLM(path, device="cpu", block_size=BLOCK, num_kv_blocks=blocks, max_model_len=64)
        runs.append([o.outputs[0].token_ids for o in llm.generate(prompts, greedy(12))])
        preemptions = llm.engine.scheduler.num_preemptions
    assert preemptions > 0
    assert runs[0] == runs[1]


# ---------------------------------------------------------------------------- dummy weights
@pytest.fixture(scope="module")
def config_only(tmp_path_factory: pytest.TempPathFactory) -> str:
    path = tmp_path_factory.mktemp("config-only")
    (path / "config.json").write_text(json.dumps(tiny_config()))
    return str(path)


def test_dummy_load(config_only: str) -> None:
    import os

    assert os.listdir(config_only) == ["config.json"]
    llm = LLM(config_only, load_format="dummy", device="cpu")
    a, b = rand_prompt(6, seed=600), rand_prompt(6, seed=601)
    outs = llm.generate([{"prompt_token_ids": a}, {"prompt_token_ids": b}], greedy(10))
    ta, tb = (o.outputs[0].token_ids for o in outs)
    assert len(ta) == len(tb) == 10
    assert all(0 <= t < 512 for t in ta + tb)
    assert ta != tb, "greedy output of random weights must depend on the input"
    # the same seed reproduces the weights, hence the tokens; another seed gives other weights
    again = LLM(config_only, load_format="dummy", device="cpu", num_kv_blocks=16)
    assert [o.outputs[0].token_ids for o in again.generate([{"prompt_token_ids": a}, {"prompt_token_ids": b}],
                                                           greedy(10))] == [ta, tb]
    other = LLM(config_only, load_format="dummy", device="cpu", num_kv_blocks=16, seed=1)
    assert other.generate([{"prompt_token_ids": a}], greedy(10))[0].outputs[0].token_ids != ta


def test_dummy_load_tied(tmp_path: Any) -> None:
    (tmp_path / "config.json").write_text(json.dumps(tiny_config(tie_word_embeddings=True, num_key_value_heads=1)))
    llm = LLM(str(tmp_path), load_format="dummy", device="cpu", num_kv_blocks=16)
    outs = llm.generate([{"prompt_token_ids": rand_prompt(5, seed=s)} for s in (1, 2)], greedy(8))
    assert all(len(o.outputs[0].token_ids) == 8 for o in outs)
    assert outs[0].outputs[0].token_ids != outs[1].outputs[0].token_ids
