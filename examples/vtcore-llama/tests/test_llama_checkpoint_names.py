"""The loader names a missing tensor as the checkpoint does, though the model renames on load."""
import os

import pytest
from safetensors.torch import load_file, save_file

from vtcore import LLM
from vtcore.errors import CheckpointError
from vtcore.testing.oracle import hf_model, save_checkpoint
from vtcore_llama.plugin import conformance_example


@pytest.mark.parametrize("name", ["model.layers.1.mlp.gate_proj.weight", "model.layers.0.self_attn.k_proj.weight",
                                  "model.norm.weight", "lm_head.weight"])
def test_missing_tensor_is_named_by_its_checkpoint_name(tmp_path, name) -> None:
    path = save_checkpoint(hf_model(conformance_example().hf_config, 0, "transformers:LlamaForCausalLM"),
                           str(tmp_path / "llama"))
    file = os.path.join(path, "model.safetensors")
    tensors = load_file(file)
    del tensors[name]
    save_file(tensors, file, metadata={"format": "pt"})
    with pytest.raises(CheckpointError) as exc:
        LLM(path, device="cpu")
    assert str(exc.value) == f"{path}: missing tensor {name!r} (not found in model.safetensors)"
