"""HF configs of real model shapes, for dummy-weight GPU runs (no network on the GPU machine).

    python scripts/model_shapes.py DIR    # writes DIR/<name>/config.json for every shape below
"""
from __future__ import annotations

import json
import os
import sys

_QWEN3 = {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "vocab_size": 151936, "head_dim": 128,
          "num_key_value_heads": 8, "max_position_embeddings": 40960, "rms_norm_eps": 1e-6,
          "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0}, "tie_word_embeddings": True,
          "torch_dtype": "bfloat16"}
SHAPES = {
    "qwen3-0.6b": {**_QWEN3, "hidden_size": 1024, "intermediate_size": 3072, "num_hidden_layers": 28,
                   "num_attention_heads": 16},
    "qwen3-4b": {**_QWEN3, "hidden_size": 2560, "intermediate_size": 9728, "num_hidden_layers": 36,
                 "num_attention_heads": 32},
    # transformers' Qwen3_5MoeTextConfig defaults (the Qwen3.5-35B-A3B text model)
    "qwen3.5-35b-a3b": {"architectures": ["Qwen3_5MoeForCausalLM"], "model_type": "qwen3_5_moe_text",
                        "vocab_size": 248320, "hidden_size": 2048, "num_hidden_layers": 40,
                        "num_attention_heads": 16, "num_key_value_heads": 2, "head_dim": 256,
                        "moe_intermediate_size": 512, "shared_expert_intermediate_size": 512, "num_experts": 256,
                        "num_experts_per_tok": 8, "linear_num_key_heads": 16, "linear_num_value_heads": 32,
                        "linear_key_head_dim": 128, "linear_value_head_dim": 128, "linear_conv_kernel_dim": 4,
                        "layer_types": [t for _ in range(10) for t in ("linear_attention",) * 3 + ("full_attention",)],
                        "rope_parameters": {"rope_theta": 10000.0, "partial_rotary_factor": 0.25,
                                            "rope_type": "default"},
                        "rms_norm_eps": 1e-6, "max_position_embeddings": 32768, "tie_word_embeddings": False,
                        "torch_dtype": "bfloat16"},
}
#: compressed-tensors' NVFP4A16 preset as llm-compressor writes it (weight-only; lm_head and, for MoE, the router
#: and shared-expert gates left dense, as published NVFP4 Qwen3 MoE checkpoints do)
_NVFP4A16 = {"quant_method": "compressed-tensors", "format": "nvfp4-pack-quantized", "kv_cache_scheme": None,
             "config_groups": {"group_0": {"targets": ["Linear"], "input_activations": None, "weights": {
                 "num_bits": 4, "type": "float", "strategy": "tensor_group", "group_size": 16, "symmetric": True,
                 "dynamic": False, "scale_dtype": "torch.float8_e4m3fn"}}},
             "ignore": ["lm_head", "re:.*mlp.gate$", "re:.*mlp.shared_expert_gate$"]}
SHAPES.update({f"{name}-nvfp4": {**SHAPES[name], "quantization_config": _NVFP4A16}
               for name in ("qwen3-4b", "qwen3.5-35b-a3b")})


def write_shape(root: str, name: str, architecture: str | None = None) -> str:
    """Write ``root/name/config.json`` (optionally under another architecture name); returns the folder."""
    path = os.path.join(root, name)
    os.makedirs(path, exist_ok=True)
    config = dict(SHAPES[name])
    if architecture:
        config["architectures"] = [architecture]
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f)
    return path


if __name__ == "__main__":
    for shape in SHAPES:
        print(write_shape(sys.argv[1], shape))
