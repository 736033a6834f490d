"""FP4 (NVFP4 / MXFP4, weight-only) Qwen3.5 checkpoints, dense and MoE, made by ``vtcore quantize``.

1. Greedy tokens pass the near-tie rule against the dense HF model of the checkpoint's decoded
   weights (the A16 token oracle; for MoE the per-expert decodes fill transformers' fused 3-D
   expert parameters), and the quantization mattered (the undecoded model disagrees somewhere).
   transformers' own compressed-tensors load (bf16) is scored too, as a printed top-1 agreement
   only: it drops the NVFP4 global scale of MoE experts (a known upstream issue).
2. Packed experts: no dense expert weight is kept, every per-expert packed tensor lands bit for bit
   in its slice; a missing one is a CheckpointError naming it; quantized and unquantized experts
   mixed in one layer, or an in_features the group size does not divide, are refused; experts a
   config leaves dense load dense beside packed Linears.
3. ``load_format="dummy"`` of a quantized MoE config, and the async engine equal to the sync one.
"""
from __future__ import annotations

import copy
import json
import os
import re
import shutil
from typing import Any, Callable

import pytest
import torch
from safetensors import safe_open

from vtcore import LLM
from vtcore.conformance.harness import build_engine, greedy, mixed_arrivals, run_engine
from vtcore.errors import CheckpointError
from vtcore.testing.checkpoints import edited_copy
from vtcore.testing.oracle import near_tie_violations, random_prompt
from vtcore.layers.moe import Experts
from vtcore.layers.quantized import take_over
from vtcore_qwen3_5.plugin import dense_example, moe_example

pytest.importorskip("compressed_tensors")

EXAMPLES = {"dense": dense_example(), "moe": moe_example()}
SCHEMES = ("NVFP4A16", "MXFP4A16")
GEN = 12
PROMPTS = [random_prompt(n, seed=70 + n) for n in (1, 9, 70)]  # 70 > one Gated DeltaNet chunk of 64
E, H, I = 8, 64, 32  # the tiny MoE: experts, hidden, moe_intermediate


def _llm(path: str, **knobs: Any) -> LLM:
    return LLM(path, **{"device": "cpu", "block_size": 4, "num_kv_blocks": 96, **knobs})


def generate(llm: LLM, prompts: list[list[int]] = PROMPTS) -> list[list[int]]:
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], greedy(GEN))
    assert all(len(o.outputs[0].token_ids) == GEN for o in outs)
    return [o.outputs[0].token_ids for o in outs]


def _raw(t: torch.Tensor) -> torch.Tensor:
    """float8 tensors as their bytes (torch.equal has no float8 kernel); others unchanged."""
    return t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t


def experts_of(llm: LLM) -> list[Experts]:
    return [m for m in llm.engine.runner.model.modules() if isinstance(m, Experts)]


@pytest.fixture(scope="module")
def store(quantized_store: Callable[..., dict[str, Any]]) -> Callable[..., dict[str, Any]]:
    return quantized_store


def cases() -> list[Any]:
    return [pytest.param(f, s, id=f"{f}-{s}") for f in EXAMPLES for s in SCHEMES]


# ---------------------------------------------------------------------------- 1. the A16 token oracle
@pytest.mark.parametrize("family,scheme", cases())
def test_greedy_tokens_match_the_decoded_dense_model(store, family: str, scheme: str) -> None:
    from vtcore.testing.quant_oracle import decoded_weights, dense_oracle

    q = store(family, scheme)
    decoded = decoded_weights(q["path"])
    per_expert = [m for m in decoded if re.search(r"\.experts\.\d+\.(gate|up|down)_proj$", m)]
    assert len(per_expert) == (4 * E * 3 if family == "moe" else 0)
    llm = _llm(q["path"])
    if family == "moe":
        assert len(experts_of(llm)) == 4 and all(x.quant is not None for x in experts_of(llm))
    tokens = generate(llm)
    q["tokens"] = tokens
    oracle = dense_oracle(copy.deepcopy(q["hf"]), q["path"])
    if family == "moe":  # the oracle's fused expert tensors hold the decodes, gate rows then up rows
        experts = oracle.model.layers[2].mlp.experts
        assert torch.equal(experts.gate_up_proj[5, I:], decoded["model.layers.2.mlp.experts.5.up_proj"])
        assert torch.equal(experts.down_proj[7], decoded["model.layers.2.mlp.experts.7.down_proj"])
    for prompt, toks in zip(PROMPTS, tokens):
        bad = near_tie_violations(oracle, prompt, toks)
        assert bad == [], f"{scheme}, prompt len {len(prompt)}: (position, ours, oracle's, gap) = {bad}"
    # the quantization really changed the model: the undecoded dense model disagrees somewhere
    assert any(near_tie_violations(q["hf"], p, t) for p, t in zip(PROMPTS, tokens))


@pytest.mark.parametrize("family,scheme", cases())
def test_transformers_own_load_agreement_is_reported(store, family: str, scheme: str) -> None:
    """transformers' bf16 load of the compressed checkpoint, teacher-forced on vtcore's tokens: the
    share of positions where its argmax is vtcore's token, printed (not a pass condition)."""
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    q = store(family, scheme)
    tokens = q["tokens"] or generate(_llm(q["path"]))
    hf_logging.disable_progress_bar()
    model = AutoModelForCausalLM.from_pretrained(q["path"], dtype=torch.bfloat16).eval()
    agree = total = 0
    with torch.no_grad():
        for prompt, toks in zip(PROMPTS, tokens):
            logits = model(torch.tensor([prompt + toks[:-1]])).logits[0, len(prompt) - 1:]
            agree += int((logits.float().argmax(-1) == torch.tensor(toks)).sum())
            total += len(toks)
    print(f"\ntransformers (bf16, compressed-tensors) top-1 agreement with vtcore, {family} {scheme}: "
          f"{agree}/{total} = {agree / total:.1%}")
    assert total == len(PROMPTS) * GEN


# ---------------------------------------------------------------------------- 2. packed experts
@pytest.mark.parametrize("scheme", SCHEMES)
def test_loaded_experts_hold_no_dense_weight_and_land_bit_for_bit(store, scheme: str) -> None:
    from vtcore.loading.weights import WeightMapper

    q = store("moe", scheme)
    llm = _llm(q["path"])
    model = llm.engine.runner.model
    nv = scheme == "NVFP4A16"
    g = 16 if nv else 32
    for x in experts_of(llm):
        assert x.gate_up_proj is None and x.down_proj is None
        shapes = {name: (tuple(p.shape), p.dtype) for name, p in x.named_parameters()}
        want = {"gate_up_weight_packed": ((E, 2 * I, H // 2), torch.uint8),
                "gate_up_weight_scale": ((E, 2 * I, H // g), torch.float8_e4m3fn if nv else torch.uint8),
                "down_weight_packed": ((E, H, I // 2), torch.uint8),
                "down_weight_scale": ((E, H, I // g), torch.float8_e4m3fn if nv else torch.uint8)}
        if nv:
            want.update({"gate_up_weight_global_scale": ((E, 2), torch.float32),
                         "down_weight_global_scale": ((E, 1), torch.float32)})
        assert shapes == want
    dense = [n for n, p in model.named_parameters() if "experts" in n and p.dtype.is_floating_point
             and p.numel() >= E * H * I // 2]
    assert dense == [], f"dense expert weights kept: {dense}"

    mapper = WeightMapper(model)
    landed = 0
    with safe_open(os.path.join(q["path"], "model.safetensors"), framework="pt") as f:
        for name in f.keys():
            if ".experts." not in name:
                continue
            pname, shard = mapper.target(name)
            view = model.get_submodule(pname.rpartition(".")[0]).shard_view(mapper.params[pname], shard)
            tensor = f.get_tensor(name)
            assert view.dtype == tensor.dtype and torch.equal(_raw(view), _raw(tensor)), name
            landed += 1
    assert landed == 4 * E * 3 * (3 if nv else 2)


@torch.no_grad()
def test_expert_forward_uses_each_shards_global_scale(store) -> None:
    """vtcore quantize gives gate and up one shared global scale, so the tokens cannot tell them
    apart: give them different ones here and check the forward against the decoded weights."""
    from vtcore.kernels.fp4 import dequantize_fp4, nvfp4_group_scales
    from vtcore.layers.activation import silu_and_mul

    x = experts_of(_llm(store("moe", "NVFP4A16")["path"]))[2]
    x.gate_up_weight_global_scale[:, 1] *= 2.0  # up
    x.down_weight_global_scale[:, 0] *= 0.5
    gen = torch.Generator().manual_seed(7)
    hidden = torch.randn(10, H, generator=gen)
    chosen = torch.stack([torch.randperm(E, generator=gen)[:2] for _ in range(10)])
    weights = torch.softmax(torch.randn(10, 2, generator=gen), -1)
    want = torch.zeros_like(hidden)
    for t in range(10):
        for slot, e in enumerate(chosen[t].tolist()):
            gs = x.gate_up_weight_global_scale[e]
            gate, up = (dequantize_fp4(x.gate_up_weight_packed[e, rows], nvfp4_group_scales(
                x.gate_up_weight_scale[e, rows], gs[i].expand(I)), 16) for i, rows in enumerate((slice(0, I),
                                                                                                  slice(I, 2 * I))))
            down = dequantize_fp4(x.down_weight_packed[e], nvfp4_group_scales(
                x.down_weight_scale[e], x.down_weight_global_scale[e].expand(H)), 16)
            h = silu_and_mul(hidden[t:t + 1] @ torch.cat([gate, up]).T)
            want[t] += (h @ down.T)[0] * weights[t, slot]
    torch.testing.assert_close(x(hidden, chosen, weights), want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("scheme", SCHEMES)
@torch.no_grad()
def test_experts_through_the_fp4_kernel(store, monkeypatch: pytest.MonkeyPatch, scheme: str) -> None:
    """The Triton FP4 GEMM path of packed experts (CUDA; else the Triton interpreter on CPU, float32)
    against the float32 torch reference path."""
    import vtcore.quant.fp4_method as fp4_method

    x = experts_of(_llm(store("moe", scheme)["path"]))[1]
    gen = torch.Generator().manual_seed(3)
    hidden = torch.randn(5, H, generator=gen)
    chosen = torch.stack([torch.randperm(E, generator=gen)[:2] for _ in range(5)])
    weights = torch.softmax(torch.randn(5, 2, generator=gen), -1)
    want = x(hidden, chosen, weights)
    if torch.cuda.is_available():
        got = x.cuda()(hidden.cuda(), chosen.cuda(), weights.cuda()).cpu()
    elif os.environ.get("TRITON_INTERPRET") == "1":
        monkeypatch.setattr(fp4_method, "use_fp4_kernel", lambda t: True)
        got = x(hidden, chosen, weights)
    else:
        pytest.skip("no CUDA and TRITON_INTERPRET is not 1")
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("scheme,deleted", [
    ("NVFP4A16", "model.layers.2.mlp.experts.5.up_proj.weight_global_scale"),
    ("NVFP4A16", "model.layers.0.mlp.experts.0.gate_proj.weight_packed"),
    ("MXFP4A16", "model.layers.3.mlp.experts.7.down_proj.weight_scale"),
])
def test_missing_per_expert_packed_tensor(store, tmp_path: Any, scheme: str, deleted: str) -> None:
    bad = edited_copy(store("moe", scheme)["path"], str(tmp_path / "broken"), lambda t: t.pop(deleted))
    with pytest.raises(CheckpointError, match=re.escape(f"missing tensor {deleted!r}")) as info:
        _llm(bad)
    assert str(info.value).count("missing tensor") == 1


def test_mixed_quantized_and_dense_experts_are_refused(store, tmp_path: Any) -> None:
    src = store("moe", "NVFP4A16")["path"]
    bad = str(tmp_path / "mixed")
    os.makedirs(bad)
    config = json.load(open(os.path.join(src, "config.json")))
    config["quantization_config"]["ignore"].append("model.layers.1.mlp.experts.3.down_proj")
    json.dump(config, open(os.path.join(bad, "config.json"), "w"))
    shutil.copy(os.path.join(src, "model.safetensors"), bad)
    with pytest.raises(CheckpointError, match=r"model\.layers\.1\.mlp\.experts:.*quantizes .*"
                       r"but not \['model\.layers\.1\.mlp\.experts\.3\.down_proj'\].*all or none"):
        _llm(bad)


def test_in_features_not_divisible_by_the_group_size(store) -> None:
    from vtcore_quant_mxfp4.method import MXFP4Method

    config = json.load(open(os.path.join(store("moe", "MXFP4A16")["path"], "config.json")))
    method = MXFP4Method(config["quantization_config"])
    model = torch.nn.Module()
    model.layer = torch.nn.Module()
    model.layer.experts = experts = Experts(4, 64, 48)  # down_proj in_features 48, MXFP4 groups of 32
    with pytest.raises(CheckpointError, match=r"layer\.experts: expert down_proj: in_features=48 is not divisible "
                                              r"by the mxfp4-pack-quantized group size 32"):
        take_over(model, method)
    # a block the config ignores by name (as vtcore quantize lists experts it leaves dense) stays dense
    method.ignore.append("layer.experts")
    take_over(model, method)
    assert experts.quant is None and experts.gate_up_proj is not None


def test_experts_left_dense_beside_packed_linears(store, tmp_path: Any) -> None:
    from vtcore.tools.quantize import quantize_checkpoint
    from vtcore.testing.quant_oracle import dense_oracle

    q = store("moe", "MXFP4A16")
    dst = str(tmp_path / "dense-experts")
    quantize_checkpoint(q["src"], dst, "MXFP4A16", ignore=[r"re:.*mlp\.experts.*"], show_progress=False)
    config = json.load(open(os.path.join(dst, "config.json")))
    assert "model.layers.0.mlp.experts" in config["quantization_config"]["ignore"]
    llm = _llm(dst)
    assert all(x.quant is None and x.gate_up_proj is not None for x in experts_of(llm))
    assert llm.engine.runner.model.model.layers[0].mlp.shared_expert.gate_up_proj.quant is not None
    tokens = generate(llm, PROMPTS[:2])
    oracle = dense_oracle(copy.deepcopy(q["hf"]), dst)
    for prompt, toks in zip(PROMPTS[:2], tokens):
        assert near_tie_violations(oracle, prompt, toks) == []


# ---------------------------------------------------------------------------- 3. dummy weights, async
@pytest.mark.parametrize("scheme", SCHEMES)
def test_dummy_load_of_a_quantized_moe_config(store, tmp_path: Any, scheme: str) -> None:
    from vtcore.kernels.fp4 import dequantize_fp4, mxfp4_group_scales, nvfp4_group_scales

    shutil.copy(os.path.join(store("moe", scheme)["path"], "config.json"), tmp_path)
    assert os.listdir(tmp_path) == ["config.json"]
    llm = _llm(str(tmp_path), load_format="dummy", num_kv_blocks=32)
    x = experts_of(llm)[1]
    assert x.quant is not None and x.gate_up_proj is None
    for which, k in (("gate_up", H), ("down", I)):
        packed, scale = getattr(x, f"{which}_weight_packed")[3], getattr(x, f"{which}_weight_scale")[3]
        if scheme == "NVFP4A16":
            rows = getattr(x, f"{which}_weight_global_scale")[3].repeat_interleave(packed.shape[0] // (2 if
                                                                                   which == "gate_up" else 1))
            w = dequantize_fp4(packed, nvfp4_group_scales(scale, rows), 16)
        else:
            w = dequantize_fp4(packed, mxfp4_group_scales(scale), 32)
        rms = float(w.pow(2).mean().sqrt()) * k ** 0.5
        assert 0.5 < rms < 2.0, f"{which}: dummy weights' rms is {rms:.2f}/sqrt(in), expected about 1"
    a, b = random_prompt(6, seed=600), random_prompt(6, seed=601)
    ta, tb = generate(llm, [a, b])
    assert ta != tb, "greedy output of random weights must depend on the input"
    again = _llm(str(tmp_path), load_format="dummy", num_kv_blocks=32)
    assert generate(again, [a, b]) == [ta, tb], "the same seed must give the same weights"


def test_async_equals_sync_on_a_quantized_moe(store) -> None:
    path = store("moe", "NVFP4A16")["path"]
    arrivals = mixed_arrivals(8, seed=5, vocab_size=512)
    knobs = dict(device="cpu", block_size=4, num_kv_blocks=200, max_num_seqs=16)
    ref, ref_batches = run_engine(build_engine(path, "sync", **knobs), arrivals)
    engine = build_engine(path, "async", **knobs)
    assert engine.depth == 2
    got, batches = run_engine(engine, arrivals)
    assert len(ref) == 8
    assert batches == ref_batches
    assert got == ref
