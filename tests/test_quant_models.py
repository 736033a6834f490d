"""Packed FP4 checkpoints made by compressed-tensors run in vtcore and agree with their decoded dense model."""
from __future__ import annotations

import copy
import os

import pytest

from vtcore import LLM, SamplingParams
from vtcore.layers.linear import Linear
from vtcore.testing.oracle import near_tie_violations

pytest.importorskip("compressed_tensors")

PROMPTS = [[1], [5, 9, 2, 7, 11, 3, 8], list(range(40, 57))]


@pytest.fixture(scope="module", params=["NVFP4A16", "MXFP4A16"])
def quantized(request, tiny_checkpoint, tmp_path_factory):
    from vtcore.tools.quantize import quantize_checkpoint

    src, hf = tiny_checkpoint
    dst = str(tmp_path_factory.mktemp(request.param))
    quantize_checkpoint(src, dst, request.param)
    return request.param, dst, hf


def test_greedy_tokens_match_the_decoded_dense_model(quantized) -> None:
    from vtcore.testing.quant_oracle import dense_oracle

    scheme, path, hf = quantized
    oracle = dense_oracle(copy.deepcopy(hf), path)
    llm = LLM(path, device="cpu", block_size=4, num_kv_blocks=64)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS],
                        SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
    for p, o in zip(PROMPTS, outs):
        assert len(o.outputs[0].token_ids) == 12
        assert near_tie_violations(oracle, p, o.outputs[0].token_ids) == [], scheme
    # the quantization really changed the model: the undecoded dense model disagrees somewhere
    assert any(near_tie_violations(hf, p, o.outputs[0].token_ids) for p, o in zip(PROMPTS, outs))


def test_a_loaded_quantized_linear_holds_no_dense_weight(quantized) -> None:
    scheme, path, _ = quantized
    model = LLM(path, device="cpu", num_kv_blocks=16).engine.runner.model
    packed = [m for m in model.modules() if isinstance(m, Linear) and m.quant is not None]
    assert len(packed) == 2 * 4  # fused qkv, o, fused gate_up, down per layer; lm_head stays dense (ignored)
    for m in packed:
        assert m.weight is None
        assert all(p.numel() < m.out_features * m.in_features // 2 + 1 for p in m.parameters(recurse=False))
    assert model.lm_head.quant is None and model.lm_head.weight is not None


def test_bad_quantized_checkpoints_name_tensor_and_expectation(quantized, tmp_path) -> None:
    import json
    import shutil

    from safetensors.torch import load_file, save_file

    from vtcore.errors import CheckpointError, NotSupportedError

    scheme, path, _ = quantized
    bad = str(tmp_path / "bad")
    shutil.copytree(path, bad)
    tensors = load_file(os.path.join(bad, "model.safetensors"))
    name = "model.layers.0.self_attn.k_proj.weight_scale"
    tensors[name] = tensors[name].view(__import__("torch").uint8) if scheme == "NVFP4A16" else \
        tensors[name].float()
    save_file(tensors, os.path.join(bad, "model.safetensors"))
    with pytest.raises(CheckpointError, match=f"tensor '{name}' has dtype"):
        LLM(bad, device="cpu", num_kv_blocks=16)
    cfg_path = os.path.join(bad, "config.json")
    cfg = json.load(open(cfg_path))
    cfg["quantization_config"]["kv_cache_scheme"] = {"num_bits": 8, "type": "float"}
    json.dump(cfg, open(cfg_path, "w"))
    with pytest.raises(NotSupportedError, match="kv_cache_scheme"):
        LLM(bad, device="cpu", num_kv_blocks=16)


@pytest.mark.parametrize("edit, error", [
    (lambda qc: qc.update(sparsity_config={"format": "sparse-bitmask", "sparsity_structure": "2:4"}),
     r"NotSupportedError: quantization_config.sparsity_config=\{.*\}: sparse weights are not supported"),
    (lambda qc: qc.update(transform_config={"config_groups": {"u": {"type": "hadamard"}}}),
     r"NotSupportedError: quantization_config.transform_config=\{.*\}: weight transforms are not supported"),
    (lambda qc: qc["config_groups"]["group_0"]["weights"].update(strategy="channel"),
     r"CheckpointError: quantization_config.config_groups.group_0.weights: \{.*'strategy': 'channel'\}, expected "
     r"\{.*'strategy': '(tensor_group|group)'\}"),
    (lambda qc: qc["config_groups"]["group_0"]["weights"].update(symmetric=False),
     r"CheckpointError: .*'symmetric': False\}, expected \{.*'symmetric': True\}"),
])
def test_quantization_settings_that_change_the_math_are_refused(quantized, tmp_path, edit, error) -> None:
    """Each loaded and generated without complaint once, from weights read the wrong way."""
    import json
    import shutil

    scheme, path, _ = quantized
    bad = str(tmp_path / "bad")
    shutil.copytree(path, bad)
    cfg_path = os.path.join(bad, "config.json")
    cfg = json.load(open(cfg_path))
    edit(cfg["quantization_config"])
    json.dump(cfg, open(cfg_path, "w"))
    with pytest.raises(Exception) as exc:
        LLM(bad, device="cpu", num_kv_blocks=16)
    assert __import__("re").match(error, f"{type(exc.value).__name__}: {exc.value}"), str(exc.value)


def test_no_op_sparsity_and_transform_configs_load(quantized, tmp_path) -> None:
    """compressed-tensors writes a 'dense' sparsity_config with no targets for models that are not
    sparse: such checkpoints load as before."""
    import json
    import shutil

    scheme, path, _ = quantized
    ok = str(tmp_path / "ok")
    shutil.copytree(path, ok)
    cfg_path = os.path.join(ok, "config.json")
    cfg = json.load(open(cfg_path))
    cfg["quantization_config"].update(
        sparsity_config={"format": "dense", "global_sparsity": 0.0, "sparsity_structure": "unstructured",
                         "targets": [], "ignore": []},
        transform_config={"config_groups": {}})
    json.dump(cfg, open(cfg_path, "w"))
    assert LLM(ok, device="cpu", num_kv_blocks=16).generate({"prompt_token_ids": [1, 2]})[0].outputs[0].token_ids


def test_dummy_load_of_a_quantized_config(quantized, tmp_path) -> None:
    import shutil

    scheme, path, _ = quantized
    folder = tmp_path / "cfg"
    folder.mkdir()
    shutil.copy(os.path.join(path, "config.json"), folder)
    llm = LLM(str(folder), device="cpu", load_format="dummy", num_kv_blocks=16)
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    a, b = (llm.generate({"prompt_token_ids": p}, params)[0].outputs[0].token_ids for p in ([1, 2, 3], [400, 9]))
    assert a != b
