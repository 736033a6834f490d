"""Tensor parallelism of vtcore's layers (``vtcore.layers.parallel``), processes over gloo on the CPU: a
Qwen3 (and Qwen3.5 dense and MoE) model built as rank 0 and rank 1 of 2 (column-parallel q/k/v and
gate/up, row-parallel o and down with one all-reduce each, a vocabulary-parallel embedding, gathered
logits; key/value heads split or, with fewer than ranks, replicated; biases of row-parallel layers added
once) gives the logits of the whole model, over a prefill and a decode step through the paged KV cache,
each rank reading only its part of each checkpoint tensor."""
from __future__ import annotations

import json
import os
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from vtcore.config import HFConfig
from vtcore.errors import CheckpointError
from vtcore.layers.parallel import tensor_parallel
from vtcore.loading.model_loader import build_model
from vtcore.testing.layers import allocate_caches, sequence_step

BLOCK = 8
PROMPT = [5, 9, 2, 7, 7, 1, 3, 8, 6, 4, 11]


def _logits(path: str) -> torch.Tensor:
    """The model's logits over ``PROMPT`` as a prefill of all but the last token, then a decode step."""
    hf = HFConfig(json.load(open(os.path.join(path, "config.json"))))
    model, _ = build_model(path, hf, torch.device("cpu"), torch.float32, 64, load_format="safetensors")
    allocate_caches(model, 2, BLOCK)
    ids, n = torch.tensor(PROMPT), len(PROMPT) - 1
    with torch.inference_mode():
        prefill = sequence_step(0, n, lambda pos: model.compute_logits(model(ids[:n], pos)))
        decode = sequence_step(n, 1, lambda pos: model.compute_logits(model(ids[n:], pos)))
    return torch.cat((prefill, decode))


def _rank(rank: int, world: int, path: str, store: str, out: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    try:
        with tensor_parallel(rank, world):
            logits = _logits(path)
        torch.save(logits, f"{out}.{rank}")
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("world, overrides", [(2, {}), (2, {"num_key_value_heads": 1}), (2, {"attention_bias": True}),
                                              (2, {"tie_word_embeddings": True}), (4, {})],
                         ids=["gqa-split", "kv-one-head", "biases", "tied", "4-ranks-kv-replicated"])
def test_ranks_give_the_whole_models_logits(make_checkpoint, tmp_path: Any, world: int, overrides: dict) -> None:
    """(4 ranks over the 2 key/value heads: ranks 0, 1 keep head 0, ranks 2, 3 head 1.)"""
    path, _ = make_checkpoint(**overrides)
    out = str(tmp_path / "logits")
    mp.spawn(_rank, args=(world, path, str(tmp_path / "store"), out), nprocs=world, join=True)
    whole = _logits(path)
    for rank in range(world):  # every rank computes the same (gathered) logits
        torch.testing.assert_close(torch.load(f"{out}.{rank}"), whole, atol=1e-5, rtol=1e-5)


def test_a_size_that_does_not_divide_the_heads_is_refused_by_name(make_checkpoint) -> None:
    path, _ = make_checkpoint(num_attention_heads=3, num_key_value_heads=3)
    hf = HFConfig(json.load(open(os.path.join(path, "config.json"))))
    with tensor_parallel(0, 2), pytest.raises(ValueError, match="tensor_parallel_size=2 does not divide"):
        build_model(path, hf, torch.device("cpu"), torch.float32, 64, load_format="dummy")


def test_a_module_that_neither_shards_nor_replicates_its_parameters_is_refused_by_name() -> None:
    from vtcore.layers.parallel import refuse_unsharded

    model = torch.nn.Sequential(torch.nn.LayerNorm(4), torch.nn.Linear(4, 4))
    refuse_unsharded(model)  # size 1: nothing to refuse
    with tensor_parallel(0, 2), pytest.raises(ValueError, match=r"module '0' \(LayerNorm\) owns parameters"):
        refuse_unsharded(model)


@pytest.fixture(scope="module")
def qwen3_5_checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    from vtcore.testing.oracle import hf_model, save_checkpoint
    from vtcore_qwen3_5.plugin import dense_example, moe_example

    return {name: save_checkpoint(hf_model(example.hf_config, seed=2), str(tmp_path_factory.mktemp(name)))
            for name, example in (("dense", dense_example()), ("moe", moe_example()))}


@pytest.mark.parametrize("family", ["dense", "moe"])
def test_qwen3_5_on_two_ranks_gives_the_whole_models_logits(qwen3_5_checkpoints, tmp_path: Any, family: str) -> None:
    """Gated DeltaNet's key and value heads (its q/k/v/z rows, conv channels, decay and out_proj columns;
    its state the rank's heads) and the MoE experts split along their intermediate size (the shared
    expert as a GatedMLP, the router replicated)."""
    path = qwen3_5_checkpoints[family]
    out = str(tmp_path / "logits")
    mp.spawn(_rank, args=(2, path, str(tmp_path / "store"), out), nprocs=2, join=True)
    whole = _logits(path)
    for rank in range(2):
        torch.testing.assert_close(torch.load(f"{out}.{rank}"), whole, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("overrides", [{}, {"tie_word_embeddings": True, "attention_bias": True}],
                         ids=["untied", "tied"])
def test_a_rank_reads_only_its_part_of_each_tensor(make_checkpoint, monkeypatch: pytest.MonkeyPatch,
                                                   overrides: dict) -> None:
    """Rank 1 of 2 loads through safetensors slices the parameters the same weight loaders make of the whole
    tensors, reading about half of the checkpoint (the norms whole)."""
    from safetensors.torch import load_file

    from vtcore.loading.lazy import LazySlice
    from vtcore.loading.weights import WeightMapper

    path, _ = make_checkpoint(**overrides)
    hf = HFConfig(json.load(open(os.path.join(path, "config.json"))))
    read, materialize = [0], LazySlice.materialize
    monkeypatch.setattr(LazySlice, "materialize", lambda self: (read.append(self.shape.numel()), materialize(self))[1])
    tensors = load_file(os.path.join(path, "model.safetensors"))
    with tensor_parallel(1, 2):
        lazy, _ = build_model(path, hf, torch.device("cpu"), torch.float32, 64, load_format="safetensors")
        whole, _ = build_model(path, hf, torch.device("cpu"), torch.float32, 64, load_format="dummy")
        mapper = WeightMapper(whole)
        for name, tensor in tensors.items():
            mapper.load(path, name, "F32", lambda: tensor)
    for (name, got), (_, want) in zip(lazy.named_parameters(), whole.named_parameters()):
        assert torch.equal(got, want), name
    assert 0.45 < sum(read) / sum(t.numel() for t in tensors.values()) < 0.55


@pytest.fixture(scope="module")
def fp4_checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """compressed-tensors FP4 checkpoints (``vtcore quantize``): a Qwen3 in MXFP4 (groups of 32) and a Qwen3.5
    MoE in NVFP4 (groups of 16, global scales per shard: each expert's gate and up), sized so that each
    rank's part of every row-parallel input (o, down, experts' down, Gated DeltaNet's out) holds whole groups."""
    pytest.importorskip("compressed_tensors")
    from vtcore.testing.oracle import hf_model, save_checkpoint, tiny_config
    from vtcore.tools.quantize import quantize_checkpoint
    from vtcore_qwen3_5.plugin import moe_example

    moe = {**moe_example().hf_config, "moe_intermediate_size": 64, "shared_expert_intermediate_size": 64,
           "linear_value_head_dim": 16}
    out = {}
    for name, config, scheme in (("qwen3-mxfp4", tiny_config(), "MXFP4A16"), ("moe-nvfp4", moe, "NVFP4A16"),
                                 ("qwen3-nvfp4-w4a4", tiny_config(), "NVFP4")):
        src = save_checkpoint(hf_model(config, seed=3), str(tmp_path_factory.mktemp(name + "-dense")))
        out[name] = str(tmp_path_factory.mktemp(name))
        quantize_checkpoint(src, out[name], scheme, show_progress=False)
    return out


@pytest.mark.parametrize("name", ["qwen3-mxfp4", "moe-nvfp4", "qwen3-nvfp4-w4a4"])
def test_fp4_checkpoints_on_two_ranks_give_the_whole_models_logits(fp4_checkpoints, tmp_path: Any, name: str) -> None:
    """Packed codes and group scales split with the rows (column-parallel) or the input groups (row-parallel,
    the experts' down), global scales whole on every rank; W4A4's input global scale, shared by the shards of one
    matrix, checked as it loads lazily (it once read the lazy slice as a tensor)."""
    path = fp4_checkpoints[name]
    assert json.load(open(os.path.join(path, "config.json")))["quantization_config"]
    out = str(tmp_path / "logits")
    mp.spawn(_rank, args=(2, path, str(tmp_path / "store"), out), nprocs=2, join=True)
    whole = _logits(path)
    for rank in range(2):
        torch.testing.assert_close(torch.load(f"{out}.{rank}"), whole, atol=1e-5, rtol=1e-5)


def test_an_fp4_layer_whose_part_of_its_input_splits_a_group_is_refused_by_name(fp4_checkpoints) -> None:
    path = fp4_checkpoints["qwen3-mxfp4"]
    config = json.load(open(os.path.join(path, "config.json")))
    hf = HFConfig({**config, "intermediate_size": 96})  # down's input: 48 a rank, not whole groups of 32
    refused = r"down_proj: in_features=48 is not divisible by the mxfp4-pack-quantized group size 32 \(this " \
              r"rank's part at tensor_parallel_size=2"
    with tensor_parallel(0, 2), pytest.raises(CheckpointError, match=refused):
        build_model(path, hf, torch.device("cpu"), torch.float32, 64, load_format="dummy")


def test_shards_of_one_matrix_with_different_input_scales_are_refused_naming_them(fp4_checkpoints, tmp_path) -> None:
    """W4A4's q, k and v see one input, so one input global scale: a checkpoint whose k_proj has its own is refused
    with each shard's value, whole or in a rank's part."""
    import shutil

    from safetensors.torch import load_file, save_file

    path = str(tmp_path / "ckpt")
    shutil.copytree(fp4_checkpoints["qwen3-nvfp4-w4a4"], path)
    file = os.path.join(path, "model.safetensors")
    tensors = load_file(file)
    key = "model.layers.0.self_attn.k_proj.input_global_scale"
    tensors[key] = tensors[key] * 2
    save_file(tensors, file, metadata={"format": "pt"})
    hf = HFConfig(json.load(open(os.path.join(path, "config.json"))))
    for rank, world in ((0, 1), (1, 2)):
        with tensor_parallel(rank, world), pytest.raises(CheckpointError) as exc:
            build_model(path, hf, torch.device("cpu"), torch.float32, 64, load_format="safetensors")
        message = str(exc.value)
        assert "tensor 'model.layers.0.self_attn.q_proj.input_global_scale' has a value its shards disagree on (" \
               "model.layers.0.self_attn.q_proj.input_global_scale = " in message, message
        assert "k_proj.input_global_scale = " in message and "so one input_global_scale is expected" in message
