"""Qwen3.5 checkpoint layouts: what real releases look like, expert formats, and dummy weights.

1. ``*ForConditionalGeneration`` folders (text under ``model.language_model.``, a vision tower
   under ``model.visual.``, plus ``mtp.*`` tensors as real releases ship them): vtcore loads the
   text model, skips the rest with one log line each, and its greedy tokens pass the near-tie
   rule against HF's ConditionalGeneration model run on token ids only.
2. Experts fused 3-D (``experts.gate_up_proj`` [E, 2I, H], ``experts.down_proj`` [E, H, I]) or per
   expert (``experts.N.{gate,up,down}_proj.weight``): same weights, identical tokens; a missing
   per-expert tensor is a CheckpointError naming it.
3. ``load_format="dummy"`` on a folder holding only config.json.
"""
from __future__ import annotations

import json
import logging
import os
import re
import shutil
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file

from vtcore.conformance.harness import greedy
from vtcore.testing.oracle import random_prompt as rand_prompt
from vtcore import LLM
from vtcore.errors import CheckpointError
from vtcore.testing.oracle import hf_model, near_tie_violations, save_checkpoint
from vtcore_qwen3_5.plugin import dense_example, moe_example

EXAMPLES = {"dense": dense_example(), "moe": moe_example()}
GEN = 12
#: a tiny vision tower; out_hidden_size is set to the text hidden size
VISION = dict(depth=1, hidden_size=32, num_heads=2, intermediate_size=64, patch_size=4, temporal_patch_size=1,
              spatial_merge_size=1, in_channels=3, num_position_embeddings=16)
_EXPERT = re.compile(r"^(.*\.mlp\.experts)\.(\d+)\.(gate|up|down)_proj\.weight$")


PROMPTS = [rand_prompt(n, seed=50 + n) for n in (1, 9, 70)]  # 70 > one Gated DeltaNet chunk of 64


def generate(llm: LLM, prompts: list[list[int]] = PROMPTS) -> list[list[int]]:
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], greedy(GEN))
    assert all(len(o.outputs[0].token_ids) == GEN for o in outs)
    return [o.outputs[0].token_ids for o in outs]


def assert_near_ties(model: torch.nn.Module, prompts: list[list[int]], tokens: list[list[int]]) -> None:
    for prompt, toks in zip(prompts, tokens):
        bad = near_tie_violations(model, prompt, toks)
        assert bad == [], f"prompt len {len(prompt)}: (position, ours, HF's, gap) = {bad}"


@torch.no_grad()
def _perturb(model: torch.nn.Module, seed: int) -> None:
    """Move HF's initial norms (0 or 1) and dt_bias (1), so that loading them matters."""
    gen = torch.Generator().manual_seed(seed + 1000)
    for name, p in model.named_parameters():
        if ("norm" in name or name.endswith("dt_bias")) and "visual" not in name:
            p.add_(torch.randn(p.shape, generator=gen) * 0.2)


def _llm(path: str, **knobs: Any) -> LLM:
    return LLM(path, **{"device": "cpu", "block_size": 4, "num_kv_blocks": 96, **knobs})


# ---------------------------------------------------------------------------- 1. real-checkpoint layout
def text_config(family: str, **overrides: Any) -> dict[str, Any]:
    """The family's tiny text config, with the interleaved-MRoPE keys real releases carry."""
    text = {k: v for k, v in EXAMPLES[family].hf_config.items() if k != "architectures"}
    text["rope_parameters"] = {**text["rope_parameters"], "mrope_section": [1, 1, 0], "mrope_interleaved": True}
    return {**text, **overrides}


def conditional_generation(family: str, seed: int, top_level: dict[str, Any] | None = None,
                           **text_overrides: Any) -> torch.nn.Module:
    """HF's Qwen3_5(Moe)ForConditionalGeneration with the tiny text model and a 1-block vision tower."""
    import transformers

    prefix = "Qwen3_5Moe" if family == "moe" else "Qwen3_5"
    text = text_config(family, **text_overrides)
    config = getattr(transformers, f"{prefix}Config")(
        text_config=text, vision_config={**VISION, "out_hidden_size": text["hidden_size"]}, **(top_level or {}))
    assert type(config.text_config).__name__ == f"{prefix}TextConfig"
    assert type(config.vision_config).__name__ == f"{prefix}VisionConfig"
    vc = config.vision_config
    assert (vc.depth, vc.hidden_size, vc.num_heads, vc.intermediate_size, vc.out_hidden_size, vc.patch_size) == \
           (1, 32, 2, 64, text["hidden_size"], 4)
    assert config.text_config.hidden_size == 64 and config.text_config.num_hidden_layers == 4
    assert getattr(config.text_config, "num_experts", None) == (8 if family == "moe" else None)
    torch.manual_seed(seed)
    model = getattr(transformers, f"{prefix}ForConditionalGeneration")(config).float().eval()
    assert len(model.model.visual.blocks) == 1
    _perturb(model, seed)
    return model


def mtp_tensors(family: str, hidden: int = 64) -> dict[str, torch.Tensor]:
    """A stand-in multi-token-prediction head, named as in the Qwen3.5 releases."""
    gen = torch.Generator().manual_seed(3)
    shapes = {"mtp.fc.weight": (hidden, 2 * hidden), "mtp.norm.weight": (hidden,),
              "mtp.pre_fc_norm_embedding.weight": (hidden,), "mtp.pre_fc_norm_hidden.weight": (hidden,),
              "mtp.layers.0.input_layernorm.weight": (hidden,),
              "mtp.layers.0.self_attn.q_proj.weight": (2 * 4 * 16, hidden)}
    if family == "moe":
        shapes.update({"mtp.layers.0.mlp.gate.weight": (8, hidden),
                       "mtp.layers.0.mlp.experts.0.gate_proj.weight": (32, hidden),
                       "mtp.layers.0.mlp.experts.gate_up_proj": (8, 64, hidden)})
    else:
        shapes["mtp.layers.0.mlp.gate_proj.weight"] = (128, hidden)
    return {name: torch.randn(shape, generator=gen) for name, shape in shapes.items()}


def add_tensors(path: str, extra: dict[str, torch.Tensor]) -> None:
    file = os.path.join(path, "model.safetensors")
    tensors = load_file(file)
    assert not set(tensors) & set(extra)
    save_file({**tensors, **extra}, file, metadata={"format": "pt"})


@pytest.mark.parametrize("family,experts", [("moe", "per-expert"), ("moe", "fused"), ("dense", None)],
                         ids=["moe-per-expert", "moe-fused", "dense"])
def test_conditional_generation_checkpoint_with_mtp(family: str, experts: str | None, tmp_path: Any,
                                                    caplog: pytest.LogCaptureFixture) -> None:
    model = conditional_generation(family, seed=21)
    path = save_checkpoint(model, str(tmp_path / "cg"))
    if experts == "fused":  # transformers 5 saves experts one by one; releases may ship them fused
        file = os.path.join(path, "model.safetensors")
        save_file(fuse_experts(load_file(file)), file, metadata={"format": "pt"})
        assert "model.language_model.layers.0.mlp.experts.gate_up_proj" in load_file(file)
    add_tensors(path, mtp_tensors(family))
    config = json.load(open(f"{path}/config.json"))
    arch = "Qwen3_5MoeForConditionalGeneration" if family == "moe" else "Qwen3_5ForConditionalGeneration"
    assert config["architectures"] == [arch] and "text_config" in config and "vision_config" in config
    names = load_file(f"{path}/model.safetensors").keys()
    assert any(n.startswith("model.language_model.layers.") for n in names)
    assert any(n.startswith("model.visual.blocks.0.") for n in names)
    assert any(n.startswith("mtp.") for n in names)

    caplog.set_level(logging.INFO, logger="vtcore")
    llm = _llm(path)
    assert llm.engine.family.name == ("qwen3_5_moe" if family == "moe" else "qwen3_5")
    skips = [r.getMessage() for r in caplog.records if "skipping" in r.getMessage()]
    vision = [m for m in skips if "vision tower" in m]
    mtp = [m for m in skips if "multi-token-prediction" in m]
    assert len(vision) == 1 and "model.visual.*" in vision[0], skips
    assert len(mtp) == 1 and "mtp.*" in mtp[0], skips
    assert len(skips) == 2, skips

    tokens = generate(llm)
    assert_near_ties(model, PROMPTS, tokens)  # HF's ConditionalGeneration on token ids only
    assert tokens == generate(_llm(path, max_num_batched_tokens=7)), "chunked prefill changed the tokens"


@pytest.mark.parametrize("top,text", [
    pytest.param(True, False, id="top-tied"),
    pytest.param(False, True, id="text-tied"),
])
def test_conditional_generation_tie_word_embeddings(top: bool, text: bool, tmp_path: Any) -> None:
    """A ConditionalGeneration checkpoint whose top-level and text_config tie_word_embeddings differ
    (transformers writes text_config's default, False, beside a top-level True)."""
    model = conditional_generation("dense", seed=23, top_level={"tie_word_embeddings": top},
                                   tie_word_embeddings=text)
    hf_tied = model.lm_head.weight.data_ptr() == model.model.language_model.embed_tokens.weight.data_ptr()
    if hf_tied != top:
        pytest.fail(f"premise: transformers was expected to tie by the top-level key ({top}), but tied={hf_tied}")
    path = save_checkpoint(model, str(tmp_path / "cg"))
    tokens = generate(_llm(path), PROMPTS[:2])
    assert_near_ties(model, PROMPTS[:2], tokens)


# ---------------------------------------------------------------------------- 2. expert formats
def fuse_experts(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Per-expert tensors -> fused ``experts.gate_up_proj`` [E, 2I, H] (gate rows, then up) and
    ``experts.down_proj`` [E, H, I]; everything else unchanged."""
    out, parts = {}, {}
    for name, t in tensors.items():
        m = _EXPERT.match(name)
        if m:
            parts.setdefault(m[1], {})[int(m[2]), m[3]] = t
        else:
            out[name] = t
    for prefix, p in parts.items():
        n = 1 + max(e for e, _ in p)
        out[f"{prefix}.gate_up_proj"] = torch.stack([torch.cat([p[e, "gate"], p[e, "up"]]) for e in range(n)])
        out[f"{prefix}.down_proj"] = torch.stack([p[e, "down"] for e in range(n)])
    return out


def split_experts(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The inverse: fused 3-D expert tensors -> ``experts.{e}.{gate,up,down}_proj.weight``."""
    out = {}
    for name, t in tensors.items():
        if name.endswith(".experts.gate_up_proj"):
            prefix, inter = name[:-len(".gate_up_proj")], t.shape[1] // 2
            for e in range(t.shape[0]):
                out[f"{prefix}.{e}.gate_proj.weight"] = t[e, :inter].clone()
                out[f"{prefix}.{e}.up_proj.weight"] = t[e, inter:].clone()
        elif name.endswith(".experts.down_proj"):
            prefix = name[:-len(".down_proj")]
            for e in range(t.shape[0]):
                out[f"{prefix}.{e}.down_proj.weight"] = t[e].clone()
        else:
            out[name] = t
    return out


def write_variant(src: str, dst: str, tensors: dict[str, torch.Tensor]) -> str:
    shutil.copytree(src, dst)
    save_file(tensors, os.path.join(dst, "model.safetensors"), metadata={"format": "pt"})
    return dst


@pytest.fixture(scope="module")
def expert_checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """The tiny MoE model saved fused and per expert (same weights), and its HF model."""
    example = EXAMPLES["moe"]
    model = hf_model(example.hf_config, seed=31, oracle=example.oracle)
    _perturb(model, 31)
    saved = save_checkpoint(model, str(tmp_path_factory.mktemp("moe-saved")))
    on_disk = load_file(f"{saved}/model.safetensors")
    in_memory = model.state_dict()
    fused = fuse_experts(on_disk)
    for layer in range(4):  # our fused layout is HF's in-memory one
        for proj, shape in (("gate_up_proj", (8, 64, 64)), ("down_proj", (8, 64, 32))):
            name = f"model.layers.{layer}.mlp.experts.{proj}"
            assert fused[name].shape == shape
            assert torch.equal(fused[name], in_memory[name])
    per_expert = split_experts(fused)
    assert per_expert.keys() == on_disk.keys() and all(torch.equal(per_expert[k], on_disk[k]) for k in on_disk)
    assert "model.layers.3.mlp.experts.7.gate_proj.weight" in per_expert
    assert per_expert["model.layers.0.mlp.experts.2.down_proj.weight"].shape == (64, 32)
    root = tmp_path_factory.mktemp("moe-formats")
    return {"model": model, "per_expert": per_expert,
            "fused": write_variant(saved, str(root / "fused"), fused),
            "split": write_variant(saved, str(root / "split"), per_expert)}


def test_fused_and_per_expert_checkpoints_agree(expert_checkpoints: dict[str, Any]) -> None:
    fused = _llm(expert_checkpoints["fused"])
    split = _llm(expert_checkpoints["split"])
    p_fused = dict(fused.engine.runner.model.named_parameters())
    p_split = dict(split.engine.runner.model.named_parameters())
    assert p_fused.keys() == p_split.keys()
    assert all(torch.equal(p_fused[k], p_split[k]) for k in p_fused), "the two formats loaded different weights"
    tokens = generate(fused)
    assert generate(split) == tokens
    assert_near_ties(expert_checkpoints["model"], PROMPTS, tokens)


@pytest.mark.parametrize("deleted", [
    "model.layers.2.mlp.experts.5.up_proj.weight",
    "model.layers.0.mlp.experts.0.gate_proj.weight",
    "model.layers.3.mlp.experts.7.down_proj.weight",
])
def test_missing_per_expert_tensor(expert_checkpoints: dict[str, Any], tmp_path: Any, deleted: str) -> None:
    """vtcore names the per-expert checkpoint tensor that is missing."""
    message = deleted
    tensors = {k: v for k, v in expert_checkpoints["per_expert"].items() if k != deleted}
    assert len(tensors) == len(expert_checkpoints["per_expert"]) - 1
    path = write_variant(expert_checkpoints["split"], str(tmp_path / "broken"), tensors)
    with pytest.raises(CheckpointError, match=re.escape(f"missing tensor {message!r}")) as info:
        _llm(path)
    assert str(info.value).count("missing tensor") == 1 and "model.safetensors" in str(info.value)


def test_per_expert_index_out_of_range(expert_checkpoints: dict[str, Any], tmp_path: Any) -> None:
    extra = "model.layers.1.mlp.experts.8.gate_proj.weight"  # 8 experts: 0..7
    tensors = {**expert_checkpoints["per_expert"], extra: torch.zeros(32, 64)}
    path = write_variant(expert_checkpoints["split"], str(tmp_path / "extra"), tensors)
    with pytest.raises(CheckpointError, match=re.escape(repr(extra))):
        _llm(path)


def test_wrong_per_expert_shape(expert_checkpoints: dict[str, Any], tmp_path: Any) -> None:
    name = "model.layers.1.mlp.experts.4.down_proj.weight"
    tensors = {**expert_checkpoints["per_expert"], name: torch.zeros(32, 64)}  # transposed: expected [64, 32]
    path = write_variant(expert_checkpoints["split"], str(tmp_path / "shape"), tensors)
    with pytest.raises(CheckpointError, match=re.escape(repr(name)) + r".*shape \(32, 64\), expected \(64, 32\)"):
        _llm(path)


# ---------------------------------------------------------------------------- 3. dummy weights
def _dummy_configs() -> dict[str, dict[str, Any]]:
    return {"dense": EXAMPLES["dense"].hf_config, "moe": EXAMPLES["moe"].hf_config,
            "moe-conditional-generation": {"architectures": ["Qwen3_5MoeForConditionalGeneration"],
                                           "model_type": "qwen3_5_moe", "text_config": text_config("moe"),
                                           "vision_config": {**VISION, "out_hidden_size": 64}}}


@pytest.mark.parametrize("name", list(_dummy_configs()))
def test_dummy_load_config_only(name: str, tmp_path: Any) -> None:
    (tmp_path / "config.json").write_text(json.dumps(_dummy_configs()[name]))
    assert os.listdir(tmp_path) == ["config.json"]
    llm = _llm(str(tmp_path), load_format="dummy", num_kv_blocks=32)
    a, b = rand_prompt(6, seed=600), rand_prompt(6, seed=601)
    ta, tb = generate(llm, [a, b])
    assert all(0 <= t < 512 for t in ta + tb)
    assert ta != tb, "greedy output of random weights must depend on the input"
    again = _llm(str(tmp_path), load_format="dummy", num_kv_blocks=32)
    assert generate(again, [a, b]) == [ta, tb], "the same seed must give the same weights"


def test_layer_types_derived_as_transformers_does(tmp_path: Any) -> None:
    """A config without ``layer_types`` (transformers derives it from ``full_attention_interval``)
    builds the same layers as transformers' own config does; it once failed on the missing field."""
    from transformers import AutoConfig

    from vtcore_qwen3_5.model import Qwen3_5ForCausalLM

    for interval in (None, 2):
        cfg = {k: v for k, v in EXAMPLES["dense"].hf_config.items() if k != "layer_types"}
        if interval:
            cfg["full_attention_interval"] = interval
        (tmp_path / "config.json").write_text(json.dumps(cfg))
        hf = AutoConfig.from_pretrained(str(tmp_path))
        llm = _llm(str(tmp_path), load_format="dummy", num_kv_blocks=32)
        model = llm.engine.runner.model
        assert isinstance(model, Qwen3_5ForCausalLM)
        got = ["linear_attention" if layer.is_linear else "full_attention" for layer in model.model.layers]
        assert got == list(hf.layer_types) and "full_attention" in got
