"""Loading checkpoints: every broken file or tensor is an error naming the file and the tensor.

Each test copies the session's tiny checkpoint into ``tmp_path`` before changing it, and crafts
files with ``safetensors.torch``.
"""
from __future__ import annotations

import json
import os
import random
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from vtcore import LLM, SamplingParams
from vtcore.errors import CheckpointError, ConfigError, MissingConfigField, UnknownArchitectureError
from vtcore.loading.safetensors_loader import INDEX, SINGLE

PROMPTS = [{"prompt_token_ids": [1, 2, 3]}, {"prompt_token_ids": [100, 7, 250, 31, 4, 8]}]
GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)


@pytest.fixture
def ckpt(tiny_checkpoint, tmp_path) -> str:
    """A private copy of the tiny checkpoint folder, free to corrupt."""
    dst = str(tmp_path / "ckpt")
    shutil.copytree(tiny_checkpoint[0], dst)
    return dst


def build(path: str, **kwargs) -> LLM:
    return LLM(path, device="cpu", num_kv_blocks=8, block_size=16, **kwargs)


def greedy_ids(llm: LLM) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY)]


def edit_tensors(path: str, edit) -> str:
    """Rewrite ``path``/model.safetensors with ``edit(dict)`` applied; returns the file path."""
    file = os.path.join(path, SINGLE)
    tensors = load_file(file)
    edit(tensors)
    save_file(tensors, file, metadata={"format": "pt"})
    return file


def edit_config(path: str, **changes) -> None:
    with open(os.path.join(path, "config.json")) as f:
        cfg = json.load(f)
    cfg.update(changes)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(cfg, f)


# ---------------------------------------------------------------------------------------- tensors
@pytest.mark.parametrize("name", [
    "model.layers.0.self_attn.k_proj.weight",  # one shard of the fused qkv_proj
    "model.layers.1.mlp.up_proj.weight",  # one shard of the fused gate_up_proj
    "model.norm.weight",
    "lm_head.weight",  # untied: the head is required
])
def test_missing_tensor(ckpt: str, name: str) -> None:
    edit_tensors(ckpt, lambda t: t.pop(name))
    with pytest.raises(CheckpointError) as exc:
        build(ckpt)
    assert str(exc.value) == f"{ckpt}: missing tensor {name!r} (not found in model.safetensors)"


def test_two_tensors_mapped_into_one_shard(ckpt: str, monkeypatch) -> None:
    """A family's packed_modules_mapping that sends up_proj into the gate shard: the second tensor into the shard is
    the error (not only the up shard left unfilled), naming both tensors and the shard."""
    from vtcore.layers.decoder import FUSED_QKV_GATE_UP, CausalLM

    monkeypatch.setattr(CausalLM, "packed_modules_mapping", {**FUSED_QKV_GATE_UP, "up_proj": ("gate_up_proj", "gate")})
    with pytest.raises(CheckpointError) as exc:
        build(ckpt)
    first, second = sorted(["model.layers.0.mlp.gate_proj.weight", "model.layers.0.mlp.up_proj.weight"])
    assert str(exc.value) == (
        f"{os.path.join(ckpt, SINGLE)}: tensor {second!r} loads into parameter "
        f"'model.layers.0.mlp.gate_up_proj.weight' shard 'gate', which tensor {first!r} already filled; expected one "
        "tensor a parameter (shard): check the model's packed_modules_mapping (or checkpoint_name)")


def test_many_missing_tensors_are_summarised(ckpt: str) -> None:
    edit_tensors(ckpt, lambda t: [t.pop(k) for k in [k for k in t if k.startswith("model.layers.1.")]])
    with pytest.raises(CheckpointError) as exc:
        build(ckpt)
    msg = str(exc.value)
    assert msg.startswith(f"{ckpt}: missing tensor 'model.layers.1.")
    assert " and 6 more (not found in model.safetensors)" in msg  # 11 tensors of layer 1, 5 shown


@pytest.mark.parametrize("name", [
    "model.layers.0.self_attn.extra_proj.weight",
    "model.layers.2.mlp.up_proj.weight",  # a layer the config does not have (and a packed name)
    "model.layers.0.self_attn.rotary_emb.inv_freq",
])
def test_unexpected_tensor(ckpt: str, name: str) -> None:
    file = edit_tensors(ckpt, lambda t: t.__setitem__(name, torch.zeros(8)))
    with pytest.raises(CheckpointError) as exc:
        build(ckpt)
    msg = str(exc.value)
    assert msg.startswith(f"{file}: unexpected tensor {name!r}: Qwen3ForCausalLM has no parameter ")


@pytest.mark.parametrize("name, shape, expected", [
    ("model.layers.0.self_attn.k_proj.weight", (33, 64),
     "has shape (33, 64), expected (32, 64) for parameter 'model.layers.0.self_attn.qkv_proj.weight' shard 'k'"),
    ("model.layers.1.mlp.down_proj.weight", (128, 64),
     "has shape (128, 64), expected (64, 128) for parameter 'model.layers.1.mlp.down_proj.weight'"),
    ("model.layers.1.input_layernorm.weight", (63,),
     "has shape (63,), expected (64,) for parameter 'model.layers.1.input_layernorm.weight'"),
])
def test_wrong_shape(ckpt: str, name: str, shape: tuple, expected: str) -> None:
    file = edit_tensors(ckpt, lambda t: t.__setitem__(name, torch.zeros(shape)))
    with pytest.raises(CheckpointError) as exc:
        build(ckpt)
    assert str(exc.value) == f"{file}: tensor {name!r} {expected}"


@pytest.mark.parametrize("dtype, tag", [(torch.int32, "I32"), (torch.int64, "I64"), (torch.float64, "F64")])
def test_unsupported_dtype(ckpt: str, dtype: torch.dtype, tag: str) -> None:
    name = "model.layers.0.mlp.gate_proj.weight"
    file = edit_tensors(ckpt, lambda t: t.__setitem__(name, t[name].to(dtype)))
    with pytest.raises(CheckpointError) as exc:
        build(ckpt)
    assert str(exc.value) == (f"{file}: tensor {name!r} has unsupported dtype {tag}, "
                              "expected one of ['BF16', 'F16', 'F32']")


def test_half_precision_tensors_load(ckpt: str) -> None:
    edit_tensors(ckpt, lambda t: t.update({k: v.to(torch.bfloat16) for k, v in t.items() if "norm" in k}))
    llm = build(ckpt)
    assert all(len(ids) == 8 for ids in greedy_ids(llm))
    assert llm.engine.runner.model.model.norm.weight.dtype == torch.float32  # converted on load


# ------------------------------------------------------------------------------------------- files
def test_truncated_file(ckpt: str) -> None:
    file = os.path.join(ckpt, SINGLE)
    with open(file, "rb") as f:
        data = f.read()
    with open(file, "wb") as f:
        f.write(data[:len(data) // 2])
    with pytest.raises(CheckpointError) as exc:
        build(ckpt)
    assert str(exc.value).startswith(f"{file}: truncated or corrupt safetensors file (")


@pytest.mark.parametrize("content", [
    random.Random(0).randbytes(4096),  # garbage: an absurd header length
    (18).to_bytes(8, "little") + b"{not json at all!}" + b"\0" * 64,  # a header that is not JSON
    b"\x01\x02",  # shorter than the header length field
    b"",
], ids=["garbage", "bad-json-header", "tiny", "empty"])
def test_corrupt_header(ckpt: str, content: bytes) -> None:
    file = os.path.join(ckpt, SINGLE)
    with open(file, "wb") as f:
        f.write(content)
    with pytest.raises(CheckpointError) as exc:
        build(ckpt)
    assert str(exc.value).startswith(f"{file}: truncated or corrupt safetensors file (Error while deserializing header")


def write_shards(path: str, names_first: int = 10) -> list[str]:
    """Split model.safetensors into two shards with an index; returns the shard file names."""
    tensors = load_file(os.path.join(path, SINGLE))
    names = sorted(tensors)
    shards = {"model-00001-of-00002.safetensors": names[:names_first],
              "model-00002-of-00002.safetensors": names[names_first:]}
    weight_map = {}
    for shard, keys in shards.items():
        save_file({k: tensors[k] for k in keys}, os.path.join(path, shard), metadata={"format": "pt"})
        weight_map.update({k: shard for k in keys})
    with open(os.path.join(path, INDEX), "w") as f:
        json.dump({"metadata": {"total_size": 0}, "weight_map": weight_map}, f)
    os.remove(os.path.join(path, SINGLE))
    return list(shards)


def test_sharded_checkpoint_loads_like_the_single_file(ckpt: str, tiny_checkpoint) -> None:
    write_shards(ckpt)
    assert not os.path.exists(os.path.join(ckpt, SINGLE))
    assert greedy_ids(build(ckpt)) == greedy_ids(build(tiny_checkpoint[0]))


def test_missing_shard(ckpt: str) -> None:
    _, second = write_shards(ckpt)
    os.remove(os.path.join(ckpt, second))
    with pytest.raises(CheckpointError) as exc:
        build(ckpt)
    assert str(exc.value) == f"{os.path.join(ckpt, second)}: shard named in {INDEX} is missing"


def test_index_without_weight_map(ckpt: str) -> None:
    write_shards(ckpt)
    with open(os.path.join(ckpt, INDEX), "w") as f:
        f.write('{"metadata": {}}')
    with pytest.raises(CheckpointError) as exc:
        build(ckpt)
    assert str(exc.value).startswith(f"{os.path.join(ckpt, INDEX)}: expected JSON with a 'weight_map' object")


@pytest.mark.parametrize("weight_map", [["a", "b"], {}])
def test_index_with_a_malformed_weight_map(ckpt: str, weight_map) -> None:
    write_shards(ckpt)
    with open(os.path.join(ckpt, INDEX), "w") as f:
        json.dump({"weight_map": weight_map}, f)
    with pytest.raises(CheckpointError) as exc:
        build(ckpt)
    assert str(exc.value) == (f"{os.path.join(ckpt, INDEX)}: weight_map is {str(weight_map)!r}, expected a "
                              "non-empty object of tensor name -> shard file")


def test_tensor_in_two_shards(ckpt: str) -> None:
    """Which copy won depended on file order (and changed the outputs), silently."""
    first, second = write_shards(ckpt)
    tensors = load_file(os.path.join(ckpt, second))
    name = sorted(load_file(os.path.join(ckpt, first)))[0]
    tensors[name] = load_file(os.path.join(ckpt, first))[name] * 2
    save_file(tensors, os.path.join(ckpt, second))
    with pytest.raises(CheckpointError) as exc:
        build(ckpt)
    assert str(exc.value) == f"{ckpt}: tensor {name!r} is in both {first} and {second}; expected one copy"


def test_tensor_missing_from_every_shard(ckpt: str) -> None:
    first, _ = write_shards(ckpt)
    shard = os.path.join(ckpt, first)
    tensors = load_file(shard)
    name = sorted(tensors)[0]
    del tensors[name]
    save_file(tensors, shard)
    with pytest.raises(CheckpointError) as exc:
        build(ckpt)
    assert str(exc.value) == (f"{ckpt}: missing tensor {name!r} (not found in "
                              "model-00001-of-00002.safetensors, model-00002-of-00002.safetensors)")


def test_no_weights_file(ckpt: str) -> None:
    os.remove(os.path.join(ckpt, SINGLE))
    with pytest.raises(CheckpointError) as exc:
        build(ckpt)
    assert str(exc.value) == (f"{ckpt}: no model.safetensors and no model.safetensors.index.json; expected HF "
                              "safetensors weights (or pass load_format='dummy' for random weights)")


def test_config_missing(ckpt: str) -> None:
    os.remove(os.path.join(ckpt, "config.json"))
    with pytest.raises(FileNotFoundError) as exc:
        build(ckpt)
    assert str(exc.value) == f"model={ckpt!r}: expected a checkpoint folder with config.json, found none"


def test_config_not_json(ckpt: str) -> None:
    with open(os.path.join(ckpt, "config.json"), "w") as f:
        f.write("{architectures: oops")
    with pytest.raises(ValueError, match=r"config\.json: not valid JSON"):
        build(ckpt)


def test_config_without_architectures(ckpt: str) -> None:
    edit_config(ckpt, architectures=None)
    with pytest.raises(ValueError, match=r"config\.json: 'architectures' is None, expected a list"):
        build(ckpt)


@pytest.mark.parametrize("changes, message", [
    (dict(num_key_value_heads=0), "num_key_value_heads=0, expected a positive integer"),
    (dict(num_attention_heads=0), "num_attention_heads=0, expected a positive integer"),
    (dict(vocab_size=-5), "vocab_size=-5, expected a positive integer"),
    (dict(vocab_size="512"), "vocab_size='512', expected a positive integer"),
    (dict(hidden_size=64.0), "hidden_size=64.0, expected a positive integer"),
    (dict(intermediate_size=0), "intermediate_size=0, expected a positive integer"),
    (dict(num_key_value_heads=3), "num_key_value_heads=3, expected a divisor of num_attention_heads=4"),
    (dict(head_dim=None, num_attention_heads=5, num_key_value_heads=5),
     "hidden_size=64 is not a multiple of num_attention_heads=5 and no head_dim is given"),
    (dict(rope_parameters={"rope_type": "default", "rope_theta": -1.0}), "rope_theta=-1.0, expected a positive finite "
     "number"),
    (dict(rms_norm_eps=0), "rms_norm_eps=0, expected a positive finite number"),
])
def test_bad_config_values_are_named(ckpt: str, changes: dict, message: str) -> None:
    """Each once failed deep in a layer or in torch (ZeroDivisionError, a negative tensor size), or
    loaded and generated NaN-driven token 0s (a negative rope_theta)."""
    edit_config(ckpt, **changes)
    with pytest.raises(ConfigError) as exc:
        build(ckpt)
    assert str(exc.value) == f"config.json: {message}"


def test_config_missing_a_field_the_model_reads(ckpt: str) -> None:
    with open(os.path.join(ckpt, "config.json")) as f:
        cfg = json.load(f)
    del cfg["num_hidden_layers"]
    with open(os.path.join(ckpt, "config.json"), "w") as f:
        json.dump(cfg, f)
    with pytest.raises(MissingConfigField) as exc:
        build(ckpt)
    assert str(exc.value) == "config.json has no field 'num_hidden_layers', which the model needs"
    assert isinstance(exc.value, AttributeError)  # getattr(config, name, default) keeps working


# ---------------------------------------------------------------------------------- tied / unknown
def test_tied_embeddings_without_lm_head(make_checkpoint) -> None:
    from vtcore.testing.oracle import near_tie_violations

    path, hf = make_checkpoint(tie_word_embeddings=True)
    assert "lm_head.weight" not in load_file(os.path.join(path, SINGLE))
    llm = build(path)
    model = llm.engine.runner.model
    assert model.lm_head.weight is model.model.embed_tokens.weight
    for prompt, ids in zip(PROMPTS, greedy_ids(llm)):
        assert near_tie_violations(hf, prompt["prompt_token_ids"], ids) == []


def test_tied_checkpoint_ignores_a_stored_lm_head(make_checkpoint, tmp_path) -> None:
    src, _ = make_checkpoint(tie_word_embeddings=True)
    reference = greedy_ids(build(src))
    path = str(tmp_path / "tied")
    shutil.copytree(src, path)
    edit_tensors(path, lambda t: t.__setitem__("lm_head.weight", torch.zeros(512, 64)))
    assert greedy_ids(build(path)) == reference


def test_unknown_architecture_in_config(ckpt: str) -> None:
    edit_config(ckpt, architectures=["FooForCausalLM"])
    with pytest.raises(UnknownArchitectureError) as exc:
        build(ckpt)
    msg = str(exc.value)
    assert "architecture 'FooForCausalLM' is not supported" in msg
    assert "qwen3_dense: Qwen3ForCausalLM" in msg


def test_first_party_architecture_in_config_says_what_to_install(ckpt: str, monkeypatch) -> None:
    from vtcore.plugins.manager import reset_plugins

    monkeypatch.setenv("VTCORE_PLUGINS", "qwen3_dense")  # as if vtcore-qwen3-5 were not installed
    monkeypatch.setattr("vtcore.plugins.manager._installed", lambda dist: False)
    reset_plugins(None)
    edit_config(ckpt, architectures=["Qwen3_5ForCausalLM"])
    with pytest.raises(UnknownArchitectureError, match="To serve it: pip install vtcore-qwen3-5"):
        build(ckpt)


# ------------------------------------------------------------------------------------ load formats
def test_dummy_load_format_needs_only_config(tiny_checkpoint, tmp_path) -> None:
    path = tmp_path / "config-only"
    path.mkdir()
    shutil.copy(os.path.join(tiny_checkpoint[0], "config.json"), path)
    a = greedy_ids(build(str(path), load_format="dummy", seed=3))
    assert [len(ids) for ids in a] == [8, 8]
    assert all(0 <= t < 512 for ids in a for t in ids)
    assert greedy_ids(build(str(path), load_format="dummy", seed=3)) == a  # seeded: reproducible
    with pytest.raises(CheckpointError, match="no model.safetensors"):
        build(str(path))


def test_bogus_load_format_names_the_valid_ones(ckpt: str) -> None:
    with pytest.raises(ValueError) as exc:
        build(ckpt, load_format="pickle")
    assert str(exc.value) == "load_format='pickle': expected one of ['auto', 'dummy', 'safetensors']"
