"""``vtcore quantize``: tiny random HF checkpoints to compressed-tensors FP4 checkpoints.

Each (model, scheme) pair is quantized once; the written config, every tensor's name, dtype and shape
are checked against the transformers model, and compressed-tensors' own decompression of the written
tensors must give back the original weights within FP4 error.
"""
from __future__ import annotations

import argparse
import io
import json
import os
import re
import shutil
from typing import Any

import pytest
import torch
from vtcore.testing.oracle import TINY_QWEN3
from safetensors.torch import load_file

pytest.importorskip("compressed_tensors")

from vtcore.plugins.manager import get_plugins  # noqa: E402
from vtcore.tools.quantize import SCHEMES, add_quantize_parser, quantize_checkpoint  # noqa: E402

GROUP = {"NVFP4A16": 16, "NVFP4": 16, "MXFP4A16": 32, "MXFP4": 32}
FORMAT = {"NVFP4A16": "nvfp4-pack-quantized", "NVFP4": "nvfp4-pack-quantized",
          "MXFP4A16": "mxfp4-pack-quantized", "MXFP4": "mxfp4-pack-quantized"}
FUSED = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"), ("in_proj_qkv", "in_proj_z"),
         ("in_proj_b", "in_proj_a"))


def _configs() -> dict[str, dict[str, Any]]:
    from vtcore_qwen3_5.plugin import dense_example, moe_example

    return {"qwen3": TINY_QWEN3, "qwen3_5": dense_example().hf_config, "qwen3_5_moe": moe_example().hf_config}


@pytest.fixture(scope="session")
def sources(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[str, torch.nn.Module]]:
    """name -> (checkpoint folder, the HF model saved there)."""
    from vtcore.testing.oracle import hf_model, save_checkpoint

    from safetensors.torch import save_file

    out = {}
    for name, cfg in _configs().items():
        model = hf_model(cfg, seed=1)
        out[name] = (save_checkpoint(model, str(tmp_path_factory.mktemp(f"src-{name}"))), model)
    # transformers writes Qwen3.5-MoE experts one by one; a checkpoint may also hold them fused
    # ([E, 2I, H] / [E, H, I], the module's own layout), plus tensors transformers does not load (MTP)
    path, model = out["qwen3_5_moe"]
    fused = str(tmp_path_factory.mktemp("src-qwen3_5_moe_fused"))
    shutil.copy(os.path.join(path, "config.json"), fused)
    tensors = {k: v.detach().contiguous() for k, v in model.state_dict().items()}
    tensors["mtp.fc.weight"] = torch.randn(64, 128)
    save_file(tensors, os.path.join(fused, "model.safetensors"), metadata={"format": "pt"})
    out["qwen3_5_moe_fused"] = (fused, model)
    return out


@pytest.fixture(scope="session")
def quantized(sources, tmp_path_factory: pytest.TempPathFactory):
    """(model name, scheme) -> the written folder, quantized once per session."""
    cache: dict[tuple[str, str], str] = {}

    def get(name: str, scheme: str) -> str:
        if (name, scheme) not in cache:
            dst = str(tmp_path_factory.mktemp(f"q-{name}-{scheme}") / "out")
            quantize_checkpoint(sources[name][0], dst, scheme, show_progress=False)
            cache[name, scheme] = dst
        return cache[name, scheme]

    return get


def _decompress(tensors: dict[str, torch.Tensor], qconfig: dict[str, Any]) -> dict[str, torch.Tensor]:
    """module prefix -> dense weight, by compressed-tensors' compressor for the written format and scheme."""
    from compressed_tensors.compressors import BaseCompressor
    from compressed_tensors.quantization import QuantizationScheme

    (group,) = qconfig["config_groups"].values()
    scheme = QuantizationScheme.model_validate(group)
    compressor = BaseCompressor.get_value_from_registry(qconfig["format"])
    out = {}
    for key in tensors:
        if key.endswith(".weight_packed"):
            prefix = key[: -len(".weight_packed")]
            local = {k[len(prefix) + 1:]: v for k, v in tensors.items()
                     if k.startswith(prefix + ".") and "." not in k[len(prefix) + 1:]}
            out[prefix] = compressor.decompress(local, scheme)["weight"].float()
    return out


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm())


@pytest.mark.parametrize("scheme", SCHEMES)
@pytest.mark.parametrize("name", ["qwen3", "qwen3_5", "qwen3_5_moe", "qwen3_5_moe_fused"])
def test_quantized_checkpoint(name: str, scheme: str, sources, quantized) -> None:
    src, model = sources[name]
    dst = quantized(name, scheme)
    group, nv, w4a4 = GROUP[scheme], scheme.startswith("NV"), not scheme.endswith("A16")

    # config.json: SRC's config plus compressed-tensors' quantization_config
    with open(os.path.join(dst, "config.json")) as f:
        config = json.load(f)
    with open(os.path.join(src, "config.json")) as f:
        src_config = json.load(f)
    assert {k: v for k, v in config.items() if k != "quantization_config"} == src_config
    qc = config["quantization_config"]
    assert qc["quant_method"] == "compressed-tensors" and qc["format"] == FORMAT[scheme]
    assert qc["quantization_status"] == "compressed" and qc["kv_cache_scheme"] is None
    (grp,) = qc["config_groups"].values()
    assert grp["targets"] == ["Linear"] and grp["format"] == FORMAT[scheme]
    w = grp["weights"]
    assert (w["num_bits"], w["type"], w["group_size"], w["symmetric"], w["dynamic"]) == (4, "float", group, True, False)
    assert w["strategy"] == ("tensor_group" if nv else "group")
    assert w["scale_dtype"] == ("torch.float8_e4m3fn" if nv else "torch.uint8")
    if w4a4:
        a = grp["input_activations"]
        assert (a["num_bits"], a["type"], a["group_size"], a["strategy"], a["dynamic"]) == \
            (4, "float", group, "tensor_group" if nv else "group", "local" if nv else True)
    else:
        assert grp["input_activations"] is None
    assert "lm_head" in qc["ignore"]
    assert os.path.exists(os.path.join(dst, "generation_config.json")) == (name != "qwen3_5_moe_fused")
    moe = name.startswith("qwen3_5_moe")

    tensors = load_file(os.path.join(dst, "model.safetensors"))
    original = load_file(os.path.join(src, "model.safetensors"))
    scale_dtype = torch.float8_e4m3fn if nv else torch.uint8

    def check_packed(prefix: str, out_f: int, in_f: int) -> None:
        assert f"{prefix}.weight" not in tensors, prefix
        assert tensors[f"{prefix}.weight_packed"].dtype == torch.uint8
        assert tensors[f"{prefix}.weight_packed"].shape == (out_f, in_f // 2), prefix
        assert tensors[f"{prefix}.weight_scale"].dtype == scale_dtype
        assert tensors[f"{prefix}.weight_scale"].shape == (out_f, in_f // group), prefix
        expected = {"weight_packed", "weight_scale"} | ({"weight_global_scale"} if nv else set()) \
            | ({"input_global_scale"} if nv and w4a4 else set())
        assert {k[len(prefix) + 1:] for k in tensors if k.startswith(prefix + ".")} == expected, prefix
        for extra in expected - {"weight_packed", "weight_scale"}:
            t = tensors[f"{prefix}.{extra}"]
            assert t.dtype == torch.float32 and t.shape == (1,) and bool(torch.isfinite(t).all() and (t > 0).all())

    # every Linear but lm_head is packed, or dense and ignored: in_features not a multiple of the group, or
    # a module the family declares a quantizer must leave alone (its pattern in the ignore list)
    declared = get_plugins().family_for(src_config["architectures"][0]).quant_ignore
    assert bool(declared) == name.startswith("qwen3_5")

    def family_ignored(n: str) -> bool:
        hit = [p for p in declared if re.match(p[3:], n)]
        assert all(p in qc["ignore"] for p in hit), (n, hit)
        return bool(hit)

    linears = {n: m for n, m in model.named_modules() if isinstance(m, torch.nn.Linear) and n != "lm_head"}
    packed = set()
    for n, m in linears.items():
        if m.in_features % group or family_ignored(n):
            assert (n in qc["ignore"] or family_ignored(n)) and torch.equal(tensors[f"{n}.weight"],
                                                                            original[f"{n}.weight"]), n
        else:
            check_packed(n, m.out_features, m.in_features)
            packed.add(n)
    assert torch.equal(tensors["lm_head.weight"], original["lm_head.weight"])
    assert any(n.endswith("self_attn.q_proj") for n in packed) and any(n.endswith("o_proj") for n in packed)
    assert moe or any(n.endswith("mlp.down_proj") for n in packed)
    if name.startswith("qwen3_5"):
        assert {"model.layers.0.linear_attn.in_proj_a", "model.layers.0.linear_attn.in_proj_b"} <= packed

    # fused MoE experts: per-expert gate/up/down for every expert, no fused tensor left
    expert_mods = {n: m for n, m in model.named_modules() if type(m).__name__.endswith("Experts")}
    assert bool(expert_mods) == moe
    for n, m in expert_mods.items():
        num, two_i, hidden = m.gate_up_proj.shape
        assert not [k for k in tensors if k.startswith(f"{n}.") and k.endswith(("proj", ".weight"))]
        for e in range(num):
            check_packed(f"{n}.{e}.gate_proj", two_i // 2, hidden)
            check_packed(f"{n}.{e}.up_proj", two_i // 2, hidden)
            check_packed(f"{n}.{e}.down_proj", hidden, two_i // 2)
            if nv:
                assert torch.equal(tensors[f"{n}.{e}.gate_proj.weight_global_scale"],
                                   tensors[f"{n}.{e}.up_proj.weight_global_scale"])
        assert f"{n}.{num}.gate_proj.weight_packed" not in tensors
    if moe:  # the router and the shared expert's gate stay dense, as the family declares
        assert "model.layers.0.mlp.shared_expert_gate" not in packed and family_ignored("model.layers.0.mlp.gate")
        assert torch.equal(tensors["model.layers.0.mlp.shared_expert_gate.weight"],
                           original["model.layers.0.mlp.shared_expert_gate.weight"])
        assert torch.equal(tensors["model.layers.0.mlp.gate.weight"], original["model.layers.0.mlp.gate.weight"])

    # every other tensor is SRC's, byte for byte (MTP too, ignored by prefix as compressed-tensors does)
    products = re.compile(r"\.(weight_packed|weight_scale|weight_global_scale|input_global_scale)$")
    for key, t in tensors.items():
        if not products.search(key):
            assert t.dtype == original[key].dtype and torch.equal(t, original[key]), key
    assert ("mtp.fc.weight" in tensors) == ("re:^mtp\\..*" in qc["ignore"]) == (name == "qwen3_5_moe_fused")

    # NVFP4: fused siblings share one weight global scale; W4A4 siblings see one input
    if nv:
        for n in packed:
            parent, child = n.rsplit(".", 1)
            for sibs in FUSED:
                if child == sibs[0] and all(f"{parent}.{s}" in packed for s in sibs):
                    for s in sibs[1:]:
                        for kind in ("weight_global_scale",) + (("input_global_scale",) if w4a4 else ()):
                            assert torch.equal(tensors[f"{parent}.{s}.{kind}"], tensors[f"{n}.{kind}"]), (n, s, kind)

    # compressed-tensors' decompression gives the weights back within FP4 error
    dense = _decompress(tensors, qc)
    assert set(dense) == packed | {f"{n}.{e}.{p}" for n, m in expert_mods.items()
                                   for e in range(m.gate_up_proj.shape[0])
                                   for p in ("gate_proj", "up_proj", "down_proj")}
    errors = {}
    for prefix, wq in dense.items():
        if prefix in packed:
            ref = original[f"{prefix}.weight"]
        else:
            experts, e, proj = prefix.rsplit(".", 2)
            if f"{prefix}.weight" in original:  # SRC stores experts one by one
                ref = original[f"{prefix}.weight"]
            else:  # fused
                gate_up = original[f"{experts}.gate_up_proj"][int(e)]
                ref = {"gate_proj": gate_up.chunk(2)[0], "up_proj": gate_up.chunk(2)[1],
                       "down_proj": original[f"{experts}.down_proj"][int(e)]}[proj]
        assert wq.shape == ref.shape, prefix
        errors[prefix] = _rel(wq, ref)
    worst = max(errors, key=errors.get)
    assert 0.01 < errors[worst] < 0.14, (worst, errors[worst])  # measured: NVFP4 <= 0.10, MXFP4 <= 0.12
    assert sum(errors.values()) / len(errors) < 0.12, sum(errors.values()) / len(errors)


E2M1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])


def _decode_reference(tensors: dict[str, torch.Tensor], prefix: str, nvfp4: bool) -> torch.Tensor:
    """The on-disk format without compressed-tensors: low nibble = even input column, bit 3 = sign,
    bits 0-2 index E2M1; NVFP4 weight = code * fp8 scale / weight_global_scale per 16 inputs,
    MXFP4 weight = code * 2 ** (uint8 scale - 127) per 32 inputs."""
    packed = tensors[f"{prefix}.weight_packed"]
    codes = torch.stack([packed & 0xF, packed >> 4], -1).flatten(-2)
    values = torch.where((codes & 8).bool(), -E2M1[(codes & 7).long()], E2M1[(codes & 7).long()])
    scale = tensors[f"{prefix}.weight_scale"].float()
    if nvfp4:
        scale = scale / tensors[f"{prefix}.weight_global_scale"]
    else:
        scale = torch.exp2(scale - 127)
    return (values.unflatten(-1, (scale.shape[-1], -1)) * scale.unsqueeze(-1)).flatten(-2)


@pytest.mark.parametrize("scheme", ["NVFP4A16", "MXFP4A16"])
def test_reference_decoder_matches_compressed_tensors(scheme: str, quantized) -> None:
    dst = quantized("qwen3_5_moe", scheme)
    tensors = load_file(os.path.join(dst, "model.safetensors"))
    with open(os.path.join(dst, "config.json")) as f:
        qc = json.load(f)["quantization_config"]
    for prefix, weight in _decompress(tensors, qc).items():  # compressed-tensors decompresses to bfloat16
        torch.testing.assert_close(_decode_reference(tensors, prefix, scheme == "NVFP4A16"), weight,
                                   rtol=2 ** -8, atol=1e-6, msg=prefix)


def test_transformers_loads_the_checkpoint(sources, quantized) -> None:
    """transformers' compressed-tensors integration loads and decompresses a written checkpoint."""
    import transformers

    src, model = sources["qwen3"]
    dst = quantized("qwen3", "NVFP4A16")
    loaded = transformers.AutoModelForCausalLM.from_pretrained(dst, dtype=torch.bfloat16)
    with torch.no_grad():
        loaded(torch.tensor([[1, 2, 3]]))  # compressed-tensors decompresses on the first forward
    original = load_file(os.path.join(src, "model.safetensors"))
    for n, m in loaded.named_modules():
        if isinstance(m, torch.nn.Linear) and n != "lm_head":
            assert _rel(m.weight, original[f"{n}.weight"]) < 0.2, n


def test_cli_quantizes_the_default_model_with_its_tokenizer(tmp_path) -> None:
    """Through argparse: the embedded default model (tied embeddings, a real tokenizer) to NVFP4 W4A4."""
    import vtcore

    src = os.path.join(os.path.dirname(vtcore.__file__), "default_model")
    parser = argparse.ArgumentParser(prog="vtcore")
    add_quantize_parser(parser.add_subparsers(dest="command", required=True))
    dst = str(tmp_path / "nvfp4")
    args = parser.parse_args(["quantize", src, dst, "--scheme", "nvfp4", "--no-progress"])
    out = io.StringIO()
    assert args.func(args, out) == 0
    assert "nvfp4-pack-quantized" in out.getvalue()
    for fname in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        assert os.path.exists(os.path.join(dst, fname)), fname
    tensors = load_file(os.path.join(dst, "model.safetensors"))
    assert "lm_head.weight" not in tensors and "model.embed_tokens.weight" in tensors  # tied, as in SRC
    igs = tensors["model.layers.0.self_attn.q_proj.input_global_scale"]
    assert igs.dtype == torch.float32 and igs.shape == (1,) and 1.0 < float(igs) < 1e6


def test_errors(tmp_path, sources) -> None:
    with pytest.raises(ValueError, match=r"'W4A16'.*NVFP4A16, MXFP4A16, NVFP4, MXFP4"):
        quantize_checkpoint(sources["qwen3"][0], str(tmp_path / "a"), "W4A16")
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="no config.json"):
        quantize_checkpoint(str(tmp_path / "empty"), str(tmp_path / "b"), "NVFP4A16")
    busy = tmp_path / "busy"
    busy.mkdir()
    (busy / "x").write_text("x")
    with pytest.raises(FileExistsError):
        quantize_checkpoint(sources["qwen3"][0], str(busy), "NVFP4A16")
    # an already quantized checkpoint is refused
    done = str(tmp_path / "done")
    shutil.copytree(sources["qwen3"][0], done)
    with open(os.path.join(done, "config.json")) as f:
        cfg = json.load(f)
    cfg["quantization_config"] = {"quant_method": "compressed-tensors"}
    with open(os.path.join(done, "config.json"), "w") as f:
        json.dump(cfg, f)
    with pytest.raises(ValueError, match="already quantized"):
        quantize_checkpoint(done, str(tmp_path / "c"), "MXFP4")


def test_errors_name_the_file_or_pattern(tmp_path, sources, monkeypatch) -> None:
    """Each once ended in a traceback (or an unnamed JSON error) from `vtcore quantize`."""
    import builtins

    with pytest.raises(ValueError, match=r"ignore pattern 're:\[': not a valid regular expression"):
        quantize_checkpoint(sources["qwen3"][0], str(tmp_path / "a"), "NVFP4A16", ignore=["re:["])
    bad = str(tmp_path / "bad")
    shutil.copytree(sources["qwen3"][0], bad)
    with open(os.path.join(bad, "model.safetensors"), "w") as f:
        f.write("garbage")
    with pytest.raises(ValueError, match=r"bad/model.safetensors: truncated or corrupt safetensors file"):
        quantize_checkpoint(bad, str(tmp_path / "b"), "NVFP4A16")
    with open(os.path.join(bad, "config.json"), "w") as f:
        f.write("{oops")
    with pytest.raises(ValueError, match=r"bad/config.json: not valid JSON"):
        quantize_checkpoint(bad, str(tmp_path / "c"), "NVFP4A16")
    real_import = builtins.__import__

    def no_compressed_tensors(name, *args, **kwargs):
        if name.startswith("compressed_tensors"):
            raise ImportError(name)
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_compressed_tensors)
    with pytest.raises(NotImplementedError, match="pip install compressed-tensors==0.20.1"):
        quantize_checkpoint(sources["qwen3"][0], str(tmp_path / "d"), "NVFP4A16")
