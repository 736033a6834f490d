"""Qwen3.5's multi-token-prediction head (``mtp.*``), built by the plugin's ``vtcore_mtp_head`` and loaded
from a checkpoint in the released layout, against a float64 reference of the architecture made of
transformers' own Qwen3.5 layers: the next token's embedding and the target's hidden state, each
zero-centred-RMS-normed, concatenated [embedding | hidden], ``fc`` from 2H to H, one full-attention
decoder layer (the MoE block in the MoE family) over the head's own paged KV cache, a final norm."""
from __future__ import annotations

import json
import os
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file

from vtcore.config import HFConfig
from vtcore.errors import ConfigError
from vtcore.loading.model_loader import build_model
from vtcore.testing.layers import allocate_caches, sequence_step
from vtcore.testing.mtp import head_drafts_from_scratch
from vtcore.testing.oracle import hf_model, save_checkpoint
from vtcore_qwen3_5.plugin import dense_example, moe_example

BLOCK, T = 4, 7  # a 7-token prefill over two 4-slot blocks, then one decode token


def _reference_modules(hf_config: dict[str, Any], seed: int) -> tuple[Any, dict[str, torch.nn.Module]]:
    """transformers' layers of the head, float64, every parameter drawn at random (norm weights around 0:
    transformers' Qwen3.5 norms scale by 1 + w)."""
    import transformers
    from transformers.models.qwen3_5 import modeling_qwen3_5 as dense
    from transformers.models.qwen3_5_moe import modeling_qwen3_5_moe as moe

    config = transformers.AutoConfig.for_model(**{k: v for k, v in hf_config.items() if k != "architectures"})
    config.layer_types = ["full_attention"] * config.num_hidden_layers
    config._attn_implementation = "eager"
    hf = moe if hf_config.get("num_experts") else dense
    prefix = "Qwen3_5Moe" if hf is moe else "Qwen3_5"
    h, eps = config.hidden_size, config.rms_norm_eps
    norm = getattr(hf, f"{prefix}RMSNorm")
    modules = {"fc": torch.nn.Linear(2 * h, h, bias=False), "norm": norm(h, eps=eps),
               "pre_fc_norm_embedding": norm(h, eps=eps), "pre_fc_norm_hidden": norm(h, eps=eps),
               "layers.0": getattr(hf, f"{prefix}DecoderLayer")(config, 0)}
    gen = torch.Generator().manual_seed(seed)
    for m in modules.values():
        m.double().eval()
        for p in m.parameters():
            p.data = torch.randn(p.shape, generator=gen, dtype=torch.float64) * 0.1
    modules["rotary"] = getattr(hf, f"{prefix}TextRotaryEmbedding")(config).double()
    return config, modules


def _reference(modules: dict[str, torch.nn.Module], embed: torch.Tensor, ids: torch.Tensor, hidden: torch.Tensor
               ) -> torch.Tensor:
    n = ids.shape[0]
    x = torch.cat((modules["pre_fc_norm_embedding"](embed[ids]), modules["pre_fc_norm_hidden"](hidden)), dim=-1)
    x = modules["fc"](x)[None]
    pos = torch.arange(n)[None]
    mask = torch.full((n, n), float("-inf"), dtype=torch.float64).triu(1)[None, None]
    # the text rotary takes multimodal (3, batch, T) position ids in older transformers releases
    rope = modules["rotary"](x, pos[None].expand(3, 1, n))
    out = modules["layers.0"](x, position_embeddings=rope, attention_mask=mask, position_ids=pos)
    out = out[0] if isinstance(out, tuple) else out
    return modules["norm"](out)[0]


def _checkpoint(tmp: str, example: Any, seed: int) -> tuple[str, dict[str, torch.nn.Module]]:
    """The example's HF model saved with a ``mtp.*`` head in the released names beside it."""
    path = save_checkpoint(hf_model(example.hf_config, seed=seed), os.path.join(tmp, "ckpt"))
    _, modules = _reference_modules(example.hf_config, seed + 1)
    tensors = load_file(os.path.join(path, "model.safetensors"))
    for name, module in modules.items():
        if name != "rotary":
            tensors.update({f"mtp.{name}.{k}": v.float().contiguous() for k, v in module.state_dict().items()})
    save_file(tensors, os.path.join(path, "model.safetensors"))
    return path, modules


@pytest.mark.parametrize("example", [dense_example(), moe_example()], ids=["dense", "moe"])
def test_mtp_head_matches_a_float64_reference_of_the_architecture(example: Any, tmp_path: Any) -> None:
    """Loaded from ``mtp.*`` (fused q/k/v and gate/up at load; MoE experts as transformers stores them), a
    prefill of 7 positions and a decode step reading the head's own KV cache agree with the reference."""
    path, modules = _checkpoint(str(tmp_path), example, seed=3)
    hf = HFConfig(json.load(open(os.path.join(path, "config.json"))))
    model, _ = build_model(path, hf, torch.device("cpu"), torch.float32, 64, load_format="safetensors", mtp=True)
    allocate_caches(model.mtp, 2, BLOCK)  # the head's own attention layer
    gen = torch.Generator().manual_seed(5)
    ids = torch.randint(0, hf.vocab_size, (T + 1,), generator=gen)
    hidden = torch.randn(T + 1, hf.hidden_size, generator=gen)
    with torch.no_grad():
        prefill = sequence_step(0, T, lambda pos: model.mtp(ids[:T], pos, hidden[:T]))
        decode = sequence_step(T, 1, lambda pos: model.mtp(ids[T:], pos, hidden[T:]))
        embed = model.model.embed_tokens.weight.double()
        expected = _reference(modules, embed, ids, hidden.double())
    torch.testing.assert_close(torch.cat((prefill, decode)).double(), expected, atol=2e-4, rtol=2e-4)
    # the head's parameters are the checkpoint's: nothing of it was left to a default
    assert torch.equal(model.mtp.fc.weight, modules["fc"].weight.float())


def test_mtp_head_refused_where_no_plugin_builds_one_or_the_checkpoint_lacks_it(tmp_path: Any) -> None:
    example = dense_example()
    path = save_checkpoint(hf_model(example.hf_config, seed=1), os.path.join(str(tmp_path), "plain"))
    hf = HFConfig(json.load(open(os.path.join(path, "config.json"))))
    with pytest.raises(Exception, match=r"mtp\.fc\.weight|mtp\."):  # the loader names the missing tensor
        build_model(path, hf, torch.device("cpu"), torch.float32, 64, load_format="safetensors", mtp=True)
    none = HFConfig({**example.hf_config, "mtp_num_hidden_layers": 0})
    with pytest.raises(ConfigError, match="'qwen3_5'.*no multi-token-prediction head"):
        build_model(path, none, torch.device("cpu"), torch.float32, 64, load_format="dummy", mtp=True)


def test_without_mtp_the_head_tensors_are_skipped(tmp_path: Any) -> None:
    path, _ = _checkpoint(str(tmp_path), dense_example(), seed=3)
    hf = HFConfig(json.load(open(os.path.join(path, "config.json"))))
    model, _ = build_model(path, hf, torch.device("cpu"), torch.float32, 64, load_format="safetensors")
    assert not hasattr(model, "mtp")


# ------------------------------------------------------------------------------ drafting in the engine
SPEC = {"method": "mtp", "num_speculative_tokens": 3}
PROMPTS = [[5, 9, 2, 7, 7, 1, 3, 8, 6], list(range(1, 21)), [11, 4, 4, 9, 30, 2]]


def _engine_llm(path: str, **knobs: Any) -> Any:
    from vtcore import LLM

    return LLM(path, **{"device": "cpu", "block_size": BLOCK, "num_kv_blocks": 96, "seed": 0, **knobs})


@pytest.mark.parametrize("eager", [True, False], ids=["general", "padded"])
@pytest.mark.parametrize("example", [dense_example(), moe_example()], ids=["dense", "moe"])
def test_mtp_drafts_are_the_heads_own_from_scratch_and_tokens_stay_exact(example: Any, eager: bool, tmp_path: Any
                                                                         ) -> None:
    """Every draft the engine keeps for a request (made on the device in the step that sampled its last
    token: its KV from earlier steps, prefill chunks of 16 tokens) equals the head run from scratch over the
    request's tokens, wherever the reference's choice is not a near-tie; greedy tokens equal those without
    speculation. Eager, every step takes the general path; else verify and decode steps and lone chunks
    take the padded ones (CUDA graphs on CUDA), the head running over the graph's outputs."""
    from vtcore.sampling_params import SamplingParams

    path, _ = _checkpoint(str(tmp_path), example, seed=3)
    hf = HFConfig(json.load(open(os.path.join(path, "config.json"))))
    reference, _ = build_model(path, hf, torch.device("cpu"), torch.float32, 64, load_format="safetensors", mtp=True)
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    plain = [o.outputs[0].token_ids for o in _engine_llm(path).generate(
        [{"prompt_token_ids": p} for p in PROMPTS], params)]
    engine = _engine_llm(path, speculative_config=SPEC, max_num_batched_tokens=16, enable_prefix_caching=False,
                         enforce_eager=eager).engine
    arrivals = {3: range(1, len(PROMPTS))}  # the 20-token prompt first, alone: lone chunks, then a mixed step
    engine.add_request("0", {"prompt_token_ids": PROMPTS[1]}, params)
    checked, done, steps = 0, {}, 0
    while engine.has_unfinished_requests() or steps in arrivals:
        for i in arrivals.get(steps, ()):
            engine.add_request(str(i), {"prompt_token_ids": PROMPTS[i - 1 if i == 1 else i]}, params)
        steps += 1
        seen = {rid: list(r.proposed) for rid, r in engine.requests.items()}
        for out in engine.step():
            if out.finished:
                done[out.request_id] = list(out.outputs[0].token_ids)
        for rid, req in engine.requests.items():
            if req.proposed and req.proposed != seen.get(rid) and not req.is_finished:
                reference_drafts = head_drafts_from_scratch(reference, req.token_ids, 3, BLOCK)
                for got, (want, margin) in zip(req.proposed, reference_drafts):
                    if margin < 1e-3:
                        break  # a near-tie: the batch's arithmetic may pick either, and the chain after it
                    assert got == want, (rid, req.token_ids, req.proposed)
                    checked += 1
    assert [done[str(i)] for i in (1, 0, 2)] == plain
    assert checked >= 30  # drafts after prefills, plain decode rows and verify rows were compared
    runner = engine.runner
    padded = (runner.padded_chunk_steps, runner.padded_decode_steps, runner.padded_verify_steps)
    assert all(padded) if not eager else not any(padded), padded
    print(padded, runner.steps_submitted)


def test_the_speculative_bench_times_the_mtp_head_and_replays_with_it_running(tmp_path: Any) -> None:
    """``vtcore bench --speculative-config '{"method": "mtp", ...}'``: the replay runs use the replayed
    drafts (all accepted) while the head still runs (sync: teacher forcing), the head's own drafts run async,
    and every run reports the head's time a step."""
    import argparse
    import io

    from vtcore.bench.serving import add_bench_parser

    path = tmp_path / "model"
    path.mkdir()
    (path / "config.json").write_text(json.dumps(moe_example().hf_config))
    parser = argparse.ArgumentParser()
    add_bench_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["bench", "--model", str(path), "--load-format", "dummy", "--device", "cpu",
                              "--no-progress", "--json", str(tmp_path / "b.json"), "--speculative-config",
                              json.dumps(SPEC), "--speculative-k", "2", "--concurrency", "1", "--input-len", "12",
                              "--output-len", "8", "--copy-mib", "16"])
    out = io.StringIO()
    assert args.func(args, out) == 0
    doc = json.loads((tmp_path / "b.json").read_text())
    assert doc["method_async_depth"] == 2  # the head's own drafts on the async engine
    (run,) = doc["runs"]
    (replay,) = run["replay"]
    assert replay["acceptance_rate"] == 1.0 and replay["mtp_head_ms"] > 0
    assert run["method"]["mtp_head_ms"] > 0 and run["method"]["outputs_equal"]
    assert "MTP head" in out.getvalue()


@pytest.mark.parametrize("knobs", [{}, {"num_kv_blocks": 14, "max_num_batched_tokens": 10},
                                   {"enable_prefix_caching": True, "state_snapshot_interval": 4}],
                         ids=["plain", "preempting", "snapshots"])
def test_async_mtp_schedules_sync_batches_without_seeing_accepted_counts(knobs: dict, tmp_path: Any) -> None:
    """With MTP the async engine schedules a request's next share before its verify row's accepted count
    reaches the host (the share floats, shifted on the device). With drafts replayed on the device so that
    verify rows accept every count, async builds the very batches sync builds and gives its tokens (greedy
    and seeded), greedy ones equal to decoding without speculation; also while preempting and with state
    snapshots for the prefix cache."""
    import random

    from vtcore.conformance.harness import greedy, run_engine
    from vtcore.sampling_params import SamplingParams
    from vtcore.testing.replay_drafts import replay_device_drafts

    path, _ = _checkpoint(str(tmp_path), dense_example(), seed=3)
    rng = random.Random(0)
    arrivals: dict[int, list] = {}
    for i in range(6):
        params = SamplingParams(temperature=1.0, seed=i, max_tokens=12, ignore_eos=True, logprobs=1) if i % 3 == 0 \
            else greedy(rng.randrange(5, 20))
        arrivals.setdefault(rng.randrange(0, 6), []).append((f"r{i}", [rng.randrange(1, 500) for _ in range(
            rng.randrange(3, 20))], params))
    plain, _ = run_engine(_engine_llm(path, async_scheduling=False).engine, arrivals)
    greedy_ids = {rid: ids for batch in arrivals.values() for rid, ids, p in batch if p.temperature == 0}
    runs = {}
    for mode in ("sync", "async"):
        engine = _engine_llm(path, speculative_config=SPEC, async_scheduling=mode == "async",
                             **{"max_num_batched_tokens": 8, **knobs}).engine
        replay_device_drafts(engine, [ids + plain[rid] for rid, ids in greedy_ids.items()])
        floating: list[int] = []
        runs[mode] = run_engine(engine, arrivals, observe=lambda b: floating.extend(s.floats for s in b if s.floats))
        assert engine.depth == (2 if mode == "async" else 1) and floating
        per_position = engine.spec_stats.accepted_per_position
        assert 0 < per_position[-1] < per_position[0] < engine.spec_stats.num_drafts
        assert engine.pool.num_free == engine.pool.num_blocks and not engine.scheduler.ending
        if "num_kv_blocks" in knobs:
            assert engine.scheduler.num_preemptions
    assert runs["async"] == runs["sync"]
    assert {rid: runs["sync"][0][rid] for rid in greedy_ids} == {rid: plain[rid] for rid in greedy_ids}


def test_mtp_needs_a_family_that_consumes_device_tokens_and_runs_async_by_default() -> None:
    from vtcore.config import EngineConfig
    from vtcore.engine.llm_engine import async_depth
    from vtcore.errors import VtcoreError

    config = EngineConfig(model="m", speculative_config=SPEC)
    assert async_depth(config, "qwen3_5", True) == 2
    with pytest.raises(VtcoreError, match="method 'mtp': model family 'plain' does not declare"):
        async_depth(config, "plain", False)
