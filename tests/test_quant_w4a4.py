"""W4A4 (activation-quantized) NVFP4 / MXFP4 checkpoints: vtcore's input fake quantization is
compressed-tensors' own, bit for bit, and W4A4 checkpoints made by compressed-tensors run in vtcore
and agree with an outside oracle: the decoded dense HF model whose every quantized Linear
fake-quantizes its input with compressed-tensors' ``forward_quantize`` (the function its quantized
``nn.Linear.forward`` calls).
"""
from __future__ import annotations

import copy
import json
import os
import shutil
import subprocess
import sys

import pytest
import torch

from vtcore import LLM, SamplingParams
from vtcore.quant.fp4_activations import fake_quantize_mxfp4_input, fake_quantize_nvfp4_input
from vtcore.testing.oracle import near_tie_violations

pytest.importorskip("compressed_tensors")

PROMPTS = [[1], [5, 9, 2, 7, 11, 3, 8], list(range(40, 57))]
_BITS = {torch.float32: torch.int32, torch.bfloat16: torch.int16}


# ------------------------------------------------------------------------ compressed-tensors, the oracle


def _ct_args(config_group: dict):
    from compressed_tensors.quantization import QuantizationArgs

    return QuantizationArgs.model_validate(config_group["input_activations"])


def _ct_preset_args(scheme: str):
    from compressed_tensors.quantization import preset_name_to_scheme

    return preset_name_to_scheme(scheme, ["Linear"]).input_activations


def _ct_fake_quantize(x: torch.Tensor, args, input_global_scale: torch.Tensor | None) -> torch.Tensor:
    """compressed-tensors' forward_quantize of a Linear's input (as its quantized forward calls it)."""
    from compressed_tensors.quantization import QuantizationStatus
    from compressed_tensors.quantization.lifecycle.forward import forward_quantize

    holder = torch.nn.Module()  # the attributes forward_quantize reads off the Linear
    holder.quantization_status = QuantizationStatus.COMPRESSED
    if input_global_scale is not None:
        holder.input_global_scale = torch.nn.Parameter(input_global_scale, requires_grad=False)
    return forward_quantize(holder, x.clone(), "input", args)


def _assert_bit_equal(ours: torch.Tensor, theirs: torch.Tensor, what: str) -> None:
    assert ours.dtype == theirs.dtype and ours.shape == theirs.shape, what
    nan = torch.isnan(ours) & torch.isnan(theirs)
    same = (ours.view(_BITS[ours.dtype]) == theirs.view(_BITS[theirs.dtype])) | nan
    assert bool(same.all()), f"{what}: {int((~same).sum())} of {same.numel()} values differ, e.g. " \
        f"{ours[~same][:4].tolist()} vs {theirs[~same][:4].tolist()}"


def _inputs(dtype: torch.dtype) -> list[tuple[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    out = []
    for scale in (1e-30, 1e-6, 1e-2, 1.0, 7.0, 1e3, 1e30):  # e4m3 / e8m0 underflow .. saturation
        x = torch.randn(3, 4, 128, generator=g) * torch.exp(torch.randn(3, 4, 128, generator=g) * 2) * scale
        x[0, 0, :32] = 0.0  # whole groups of zeros (NVFP4: 2 groups, MXFP4: 1)
        x[1, 1, 16:48] = -0.0
        x[2, 3] = 0.0
        out.append((f"scale {scale:g}", x.to(dtype)))
    # every e2m1 rounding tie and bucket edge, at scales where x / s is exact
    t = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0, 0.2, 0.3, 5.5, 4.5, 2.9, 1.1, 0.6, 0.0] * 2)
    out.append(("ties", torch.stack([t, -t, t * 0.5, t * 4]).to(dtype)))
    # group maxima across the power-of-two rounding edge of the e8m0 scale (significand 1.75)
    edge = torch.zeros(8, 32)
    edge[:, 0] = torch.tensor([1.4, 1.5, 1.6, 1.74, 1.75, 1.76, 1.99, 2.0]) * 4
    edge[:, 1:] = torch.linspace(-3, 3, 31)
    out.append(("e8m0 edge", edge.to(dtype)))
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_nvfp4_input_fake_quant_is_compressed_tensors_bit_for_bit(dtype) -> None:
    args = _ct_preset_args("NVFP4")
    for name, x in _inputs(dtype):
        amax = float(x.float().abs().max())
        for gs in (1.0, 823.686, 448.0 * 6.0 / max(amax, 1e-30)):  # incl. the calibrated-on-x global scale
            igs = torch.tensor([gs], dtype=torch.float32)
            _assert_bit_equal(fake_quantize_nvfp4_input(x, igs), _ct_fake_quantize(x, args, igs),
                              f"NVFP4 {dtype} {name} global {gs:g}")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_mxfp4_input_fake_quant_is_compressed_tensors_bit_for_bit(dtype) -> None:
    args = _ct_preset_args("MXFP4")
    for name, x in _inputs(dtype):
        _assert_bit_equal(fake_quantize_mxfp4_input(x), _ct_fake_quantize(x, args, None), f"MXFP4 {dtype} {name}")
    # every finite non-negative bf16 value (and its negation) as an element and as a group maximum
    every = torch.arange(0, 0x7F80, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)
    x = every[: every.numel() // 32 * 32].to(dtype).reshape(-1, 32)
    x = torch.cat([x, -x])[torch.randperm(2 * x.shape[0], generator=torch.Generator().manual_seed(1))]
    _assert_bit_equal(fake_quantize_mxfp4_input(x), _ct_fake_quantize(x, args, None), f"MXFP4 {dtype} every bf16")
    nv = _ct_preset_args("NVFP4")
    xs, igs = x.reshape(-1, 16) * 1e-3, torch.tensor([5000.0])
    _assert_bit_equal(fake_quantize_nvfp4_input(xs, igs), _ct_fake_quantize(xs, nv, igs), f"NVFP4 {dtype} every bf16")


def test_runtime_modules_do_not_import_compressed_tensors() -> None:
    code = ("import sys, vtcore.quant.fp4_activations, vtcore.quant.fp4_method\n"
            "bad = sorted(m for m in sys.modules if m.split('.')[0] == 'compressed_tensors')\n"
            "assert not bad, bad\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr


# ------------------------------------------------------------------------ W4A4 checkpoints in vtcore


@pytest.fixture(scope="module", params=["NVFP4", "MXFP4"])
def w4a4(request, tiny_checkpoint, tmp_path_factory):
    from vtcore.tools.quantize import quantize_checkpoint

    src, hf = tiny_checkpoint
    dst = str(tmp_path_factory.mktemp(request.param))
    quantize_checkpoint(src, dst, request.param, show_progress=False)
    return request.param, dst, hf


def _act_quant_oracle(hf: torch.nn.Module, path: str) -> tuple[torch.nn.Module, torch.nn.Module]:
    """(A16 oracle, W4A4 oracle): the decoded dense HF model, and a copy whose quantized Linears
    fake-quantize their input with compressed-tensors, with the checkpoint's args and global scales."""
    from safetensors.torch import load_file

    from vtcore.testing.quant_oracle import dense_oracle

    a16 = dense_oracle(copy.deepcopy(hf), path)
    w4a4 = copy.deepcopy(a16)
    qc = json.load(open(os.path.join(path, "config.json")))["quantization_config"]
    (group,) = qc["config_groups"].values()
    args = _ct_args(group)
    tensors = load_file(os.path.join(path, "model.safetensors"))
    hooked = 0
    for name, module in w4a4.named_modules():
        if isinstance(module, torch.nn.Linear) and f"{name}.weight_packed" in tensors:
            igs = tensors.get(f"{name}.input_global_scale")
            module.register_forward_pre_hook(lambda m, inp, igs=igs: (_ct_fake_quantize(inp[0], args, igs),))
            hooked += 1
    assert hooked == 2 * 7  # q, k, v, o, gate, up, down per layer
    return a16, w4a4


def test_w4a4_tokens_match_the_activation_quantized_oracle(w4a4) -> None:
    scheme, path, hf = w4a4
    a16, oracle = _act_quant_oracle(hf, path)
    llm = LLM(path, device="cpu", block_size=4, num_kv_blocks=64)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS],
                        SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, prompt_logprobs=0))
    for p, o in zip(PROMPTS, outs):
        assert len(o.outputs[0].token_ids) == 12
        assert near_tie_violations(oracle, p, o.outputs[0].token_ids) == [], scheme

    # The activation quantization is really applied: vtcore's prompt logprobs are the W4A4 oracle's
    # (to float noise) and clearly not the weight-only model's.
    ids = PROMPTS[2]
    ours = torch.tensor([pos[tok].logprob for pos, tok in zip(outs[2].prompt_logprobs[1:], ids[1:])])
    with torch.no_grad():
        def logprobs(model):
            lp = torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), -1)
            return lp[torch.arange(len(ids) - 1), torch.tensor(ids[1:])]
        want, a16_lp = logprobs(oracle), logprobs(a16)
    assert (ours - want).abs().max() < 1e-3, (scheme, ours, want)
    assert (want - a16_lp).abs().max() > 2e-2, (scheme, want, a16_lp)
    assert (ours - a16_lp).abs().max() > 2e-2, scheme


def test_w4a4_parameters_and_dummy_load(w4a4, tmp_path) -> None:
    from vtcore.layers.linear import Linear

    scheme, path, _ = w4a4
    model = LLM(path, device="cpu", num_kv_blocks=16).engine.runner.model
    packed = [m for m in model.modules() if isinstance(m, Linear) and m.quant is not None]
    assert len(packed) == 2 * 4 and all(m.quant.quantize_inputs for m in packed)
    for m in packed:
        igs = getattr(m, "input_global_scale", None)
        if scheme == "NVFP4":  # one per shard, all equal (one input), float32
            assert igs.dtype == torch.float32 and igs.numel() == len(m.shard_names)
            assert bool((igs == igs[0]).all()) and float(igs[0]) > 0
        else:
            assert igs is None
    folder = tmp_path / "cfg"
    folder.mkdir()
    shutil.copy(os.path.join(path, "config.json"), folder)
    llm = LLM(str(folder), device="cpu", load_format="dummy", num_kv_blocks=16)
    dummy = [m for m in llm.engine.runner.model.modules() if isinstance(m, Linear) and m.quant is not None]
    if scheme == "NVFP4":
        assert all(bool(torch.isfinite(m.input_global_scale).all()) and float(m.input_global_scale.min()) > 0
                   for m in dummy)
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    a, b = (llm.generate({"prompt_token_ids": p}, params)[0].outputs[0].token_ids for p in ([1, 2, 3], [400, 9]))
    assert a != b


@pytest.mark.parametrize("field, value", [("group_size", 32), ("dynamic", False), ("num_bits", 8),
                                          ("strategy", "tensor")])
def test_a_wrong_input_activations_group_is_refused_naming_the_field(w4a4, tmp_path, field, value) -> None:
    from vtcore.errors import NotSupportedError

    scheme, path, _ = w4a4
    if field == "group_size" and scheme == "MXFP4":
        value = 16
    bad = tmp_path / "bad"
    bad.mkdir()
    cfg = json.load(open(os.path.join(path, "config.json")))
    cfg["quantization_config"]["config_groups"]["group_0"]["input_activations"][field] = value
    json.dump(cfg, open(bad / "config.json", "w"))
    with pytest.raises(NotSupportedError, match=rf"input_activations\.{field}={value!r}: expected"):
        LLM(str(bad), device="cpu", load_format="dummy", num_kv_blocks=16)


def test_fused_shards_with_different_input_global_scales_are_refused(w4a4, tmp_path) -> None:
    from safetensors.torch import load_file, save_file

    from vtcore.errors import CheckpointError

    scheme, path, _ = w4a4
    if scheme != "NVFP4":
        pytest.skip("MXFP4 stores no input scale")
    bad = str(tmp_path / "bad")
    shutil.copytree(path, bad)
    tensors = load_file(os.path.join(bad, "model.safetensors"))
    name = "model.layers.1.self_attn.v_proj.input_global_scale"
    tensors[name] = tensors[name] * 2
    save_file(tensors, os.path.join(bad, "model.safetensors"))
    with pytest.raises(CheckpointError, match=rf"{name}.*one input_global_scale is expected"):
        LLM(bad, device="cpu", num_kv_blocks=16)
    tensors[name] = tensors[name].double()
    save_file(tensors, os.path.join(bad, "model.safetensors"))
    with pytest.raises(CheckpointError, match=f"tensor '{name}' has dtype F64"):
        LLM(bad, device="cpu", num_kv_blocks=16)
