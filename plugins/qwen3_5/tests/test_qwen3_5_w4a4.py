"""W4A4 (activation-quantized) NVFP4 / MXFP4 Qwen3.5 checkpoints, dense and MoE, made by ``vtcore quantize``.

The oracle is the decoded dense HF model (``dense_oracle``: the checkpoint's decoded weights, for MoE
filling transformers' fused 3-D expert parameters) whose every quantized Linear fake-quantizes its
input with compressed-tensors' own ``forward_quantize`` (a forward pre-hook, the function its
quantized ``nn.Linear.forward`` calls), and whose every expert projection does too: transformers'
``Qwen3_5MoeExperts.forward`` calls ``F.linear`` on slices of its fused parameters inside a loop, so
it cannot be hooked per projection; each experts module's forward is replaced by the same loop
(copied from transformers) with compressed-tensors' ``forward_quantize`` applied to the expert's
input before its gate_up matmul and before its down matmul, with that projection's checkpoint
``input_global_scale`` (NVFP4) or none (MXFP4, dynamic). The input quantization is per token row
(groups along the hidden dimension), so the oracle's per-expert token gathering does not change it.

1. vtcore's greedy tokens pass the near-tie rule against that oracle, its prompt logprobs are the
   oracle's to float noise, and clearly not those of the same weights without input quantization.
2. Packed W4A4 experts: their input global scales (NVFP4) land per expert as float32, a missing one
   is a CheckpointError naming it, gate/up values that differ are refused naming both, and a dummy
   load runs.
"""
from __future__ import annotations

import copy
import json
import os
import re
import shutil
import types
from typing import Any, Callable

import pytest
import torch
from safetensors.torch import load_file

from vtcore import LLM, SamplingParams
from vtcore.errors import CheckpointError
from vtcore.testing.checkpoints import edited_copy
from vtcore.testing.oracle import near_tie_violations, random_prompt
from vtcore.layers.moe import Experts
from vtcore_qwen3_5.plugin import dense_example, moe_example

pytest.importorskip("compressed_tensors")

EXAMPLES = {"dense": dense_example(), "moe": moe_example()}
SCHEMES = ("NVFP4", "MXFP4")
GEN = 10
PROMPTS = [random_prompt(n, seed=170 + n) for n in (1, 9, 70)]  # 70 > one Gated DeltaNet chunk of 64
E, H, I = 8, 64, 32  # the tiny MoE: experts, hidden, moe_intermediate
_PER_EXPERT = re.compile(r"^(.*\.experts)\.(\d+)\.(gate|up|down)_proj\.weight_packed$")


def _llm(path: str, **knobs: Any) -> LLM:
    return LLM(path, **{"device": "cpu", "block_size": 4, "num_kv_blocks": 96, **knobs})


@pytest.fixture(scope="module")
def store(quantized_store: Callable[..., dict[str, Any]]) -> Callable[..., dict[str, Any]]:
    return quantized_store


# ---------------------------------------------------------------------------- compressed-tensors, the oracle
def _ct_fake_quantize(x: torch.Tensor, args: Any, input_global_scale: torch.Tensor | None) -> torch.Tensor:
    """compressed-tensors' forward_quantize of a Linear's input (as its quantized forward calls it)."""
    from compressed_tensors.quantization import QuantizationStatus
    from compressed_tensors.quantization.lifecycle.forward import forward_quantize

    holder = torch.nn.Module()  # the attributes forward_quantize reads off the Linear
    holder.quantization_status = QuantizationStatus.COMPRESSED
    if input_global_scale is not None:
        holder.input_global_scale = torch.nn.Parameter(input_global_scale, requires_grad=False)
    return forward_quantize(holder, x.clone(), "input", args)


def _quantized_experts_forward(args: Any, scales: dict[int, tuple[Any, Any]]):
    """transformers' Qwen3_5MoeExperts.forward loop, each expert's gate_up and down inputs fake-quantized
    by compressed-tensors with that expert's (gate_proj, down_proj) input_global_scale."""
    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor):
        final_hidden_states = torch.zeros_like(hidden_states)
        with torch.no_grad():
            expert_mask = torch.nn.functional.one_hot(top_k_index, num_classes=self.num_experts + 1)
            expert_mask = expert_mask.permute(2, 1, 0)
            expert_hit = torch.greater(expert_mask.sum(dim=(-1, -2)), 0).nonzero()
        for expert_idx in expert_hit:
            expert_idx = int(expert_idx[0])
            if expert_idx == self.num_experts:
                continue
            top_k_pos, token_idx = torch.where(expert_mask[expert_idx])
            gate_up_igs, down_igs = scales[expert_idx]
            current_state = _ct_fake_quantize(hidden_states[token_idx], args, gate_up_igs)
            gate, up = torch.nn.functional.linear(current_state, self.gate_up_proj[expert_idx]).chunk(2, dim=-1)
            current_hidden_states = _ct_fake_quantize(self.act_fn(gate) * up, args, down_igs)
            current_hidden_states = torch.nn.functional.linear(current_hidden_states, self.down_proj[expert_idx])
            current_hidden_states = current_hidden_states * top_k_weights[token_idx, top_k_pos, None]
            final_hidden_states.index_add_(0, token_idx, current_hidden_states.to(final_hidden_states.dtype))
        return final_hidden_states
    return forward


def _oracles(hf: torch.nn.Module, path: str) -> tuple[torch.nn.Module, torch.nn.Module]:
    """(A16 oracle, W4A4 oracle): the decoded dense HF model, and a copy whose quantized Linears and
    expert projections fake-quantize their inputs with compressed-tensors."""
    from compressed_tensors.quantization import QuantizationArgs

    from vtcore.testing.quant_oracle import dense_oracle

    a16 = dense_oracle(copy.deepcopy(hf), path)
    w4a4 = copy.deepcopy(a16)
    qc = json.load(open(os.path.join(path, "config.json")))["quantization_config"]
    (group,) = qc["config_groups"].values()
    args = QuantizationArgs.model_validate(group["input_activations"])
    tensors = load_file(os.path.join(path, "model.safetensors"))
    nv = args.group_size == 16
    linears = {n.removesuffix(".weight_packed") for n in tensors if n.endswith(".weight_packed")
               and not _PER_EXPERT.match(n)}
    experts: dict[str, set[int]] = {}
    for n in tensors:
        if m := _PER_EXPERT.match(n):
            experts.setdefault(m.group(1), set()).add(int(m.group(2)))
    hooked, patched = set(), set()
    for name, module in w4a4.named_modules():
        if isinstance(module, torch.nn.Linear) and name in linears:
            igs = tensors[f"{name}.input_global_scale"] if nv else None
            module.register_forward_pre_hook(lambda m, inp, igs=igs: (_ct_fake_quantize(inp[0], args, igs),))
            hooked.add(name)
        elif name in experts:
            scales = {e: (tensors[f"{name}.{e}.gate_proj.input_global_scale"],
                          tensors[f"{name}.{e}.down_proj.input_global_scale"]) if nv else (None, None)
                      for e in range(module.num_experts)}
            module.forward = types.MethodType(_quantized_experts_forward(args, scales), module)
            patched.add(name)
    assert hooked == linears and linears, sorted(linears - hooked)
    assert patched == set(experts), sorted(set(experts) - patched)
    return a16, w4a4


def cases() -> list[Any]:
    return [pytest.param(f, s, id=f"{f}-{s}") for f in EXAMPLES for s in SCHEMES]


# ---------------------------------------------------------------------------- 1. the W4A4 token oracle
@pytest.mark.parametrize("family,scheme", cases())
def test_w4a4_tokens_match_the_activation_quantized_oracle(store, family: str, scheme: str) -> None:
    q = store(family, scheme)
    qc = json.load(open(os.path.join(q["path"], "config.json")))["quantization_config"]
    assert all(g.get("input_activations") for g in qc["config_groups"].values())
    a16, oracle = _oracles(q["hf"], q["path"])
    llm = _llm(q["path"])
    experts = [m for m in llm.engine.runner.model.modules() if isinstance(m, Experts)]
    assert len(experts) == (4 if family == "moe" else 0)
    assert all(x.quant is not None and x.quant.quantize_inputs and not x.supports_decode_graphs for x in experts)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS],
                        SamplingParams(temperature=0, max_tokens=GEN, ignore_eos=True, prompt_logprobs=0))
    for p, o in zip(PROMPTS, outs):
        toks = o.outputs[0].token_ids
        assert len(toks) == GEN
        bad = near_tie_violations(oracle, p, toks)
        assert bad == [], f"{family} {scheme}, prompt len {len(p)}: (position, ours, oracle's, gap) = {bad}"

    # The input quantization is really applied, to the experts too: vtcore's prompt logprobs are the
    # W4A4 oracle's (to float noise) and clearly not those of the same weights at 16-bit activations.
    ids = PROMPTS[2]
    ours = torch.tensor([pos[tok].logprob for pos, tok in zip(outs[2].prompt_logprobs[1:], ids[1:])])
    with torch.no_grad():
        def logprobs(model: torch.nn.Module) -> torch.Tensor:
            lp = torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), -1)
            return lp[torch.arange(len(ids) - 1), torch.tensor(ids[1:])]
        want, a16_lp = logprobs(oracle), logprobs(a16)
    assert (ours - want).abs().max() < 1e-3, (family, scheme, (ours - want).abs().max())
    assert (want - a16_lp).abs().max() > 2e-2, (family, scheme)
    assert (ours - a16_lp).abs().max() > 2e-2, (family, scheme)
    if family == "moe":  # and the experts' input quantization alone is visible in the logprobs
        _, partial = _oracles(q["hf"], q["path"])
        for x in (m for m in partial.modules() if "forward" in vars(m)):
            del x.forward  # back to transformers' unquantized expert loop
        assert (ours - logprobs(partial)).abs().max() > 2e-2, (family, scheme)


# ---------------------------------------------------------------------------- 2. packed W4A4 experts
def test_w4a4_expert_parameters_and_dummy_load(store, tmp_path: Any) -> None:
    for scheme in SCHEMES:
        path = store("moe", scheme)["path"]
        tensors = load_file(os.path.join(path, "model.safetensors"))
        experts = [m for m in _llm(path).engine.runner.model.modules() if isinstance(m, Experts)]
        for layer, x in enumerate(experts):
            if scheme == "MXFP4":
                assert not hasattr(x, "gate_up_input_global_scale") and not hasattr(x, "down_input_global_scale")
                assert not any(n.endswith("input_global_scale") for n in tensors if ".experts." in n)
                continue
            gu, dn = x.gate_up_input_global_scale, x.down_input_global_scale
            assert (gu.dtype, tuple(gu.shape), dn.dtype, tuple(dn.shape)) == \
                (torch.float32, (E, 2), torch.float32, (E, 1))
            prefix = f"model.layers.{layer}.mlp.experts"
            for e in range(E):
                assert torch.equal(gu[e], torch.cat([tensors[f"{prefix}.{e}.gate_proj.input_global_scale"],
                                                     tensors[f"{prefix}.{e}.up_proj.input_global_scale"]]))
                assert torch.equal(dn[e], tensors[f"{prefix}.{e}.down_proj.input_global_scale"])
        folder = tmp_path / scheme
        folder.mkdir()
        shutil.copy(os.path.join(path, "config.json"), folder)
        llm = _llm(str(folder), load_format="dummy", num_kv_blocks=32)
        x = [m for m in llm.engine.runner.model.modules() if isinstance(m, Experts)][1]
        assert x.quant.quantize_inputs
        if scheme == "NVFP4":
            assert all(bool(torch.isfinite(p).all()) and float(p.min()) > 0
                       for p in (x.gate_up_input_global_scale, x.down_input_global_scale))
        params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
        a, b = (llm.generate({"prompt_token_ids": p}, params)[0].outputs[0].token_ids
                for p in (random_prompt(6, seed=600), random_prompt(6, seed=601)))
        assert a != b, "greedy output of random weights must depend on the input"


@pytest.mark.parametrize("deleted", ["model.layers.2.mlp.experts.5.up_proj.input_global_scale",
                                     "model.layers.0.mlp.experts.7.down_proj.input_global_scale"])
def test_missing_expert_input_global_scale(store, tmp_path: Any, deleted: str) -> None:
    bad = edited_copy(store("moe", "NVFP4")["path"], str(tmp_path / "broken"), lambda t: t.pop(deleted))
    with pytest.raises(CheckpointError, match=re.escape(f"missing tensor {deleted!r}")) as info:
        _llm(bad)
    assert str(info.value).count("missing tensor") == 1


def test_gate_and_up_input_global_scales_that_differ_are_refused(store, tmp_path: Any) -> None:
    name = "model.layers.1.mlp.experts.3.up_proj.input_global_scale"
    bad = edited_copy(store("moe", "NVFP4")["path"], str(tmp_path / "differ"), lambda t: t[name].mul_(2))
    gate = re.escape(name.replace("up_proj", "gate_proj"))
    with pytest.raises(CheckpointError, match=rf"{gate} = .* and {re.escape(name)} = .* differ.*"
                                              r"one input_global_scale is expected"):
        _llm(bad)
