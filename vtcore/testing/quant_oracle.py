"""The token oracle of a packed FP4 checkpoint: the dense float32 HF model of its decoded weights.

vtcore's float32 decode is checked bit for bit (rounded to bf16) against compressed-tensors'
``decompress`` in tests/test_fp4.py; this builds the dense model from that decode, so greedy
tokens of the quantized engine can be held to the near-tie rule.
"""
from __future__ import annotations

import os
from typing import Any

import torch
from safetensors import safe_open

from vtcore.quant.fp4 import dequantize_fp4, mxfp4_group_scales, nvfp4_group_scales


def decoded_weights(path: str) -> dict[str, torch.Tensor]:
    """Module name -> float32 dense weight, for every packed Linear in the checkpoint's safetensors."""
    tensors: dict[str, torch.Tensor] = {}
    for name in sorted(os.listdir(path)):
        if name.endswith(".safetensors"):
            with safe_open(os.path.join(path, name), framework="pt") as f:
                tensors.update({k: f.get_tensor(k) for k in f.keys()})
    out = {}
    for key, packed in tensors.items():
        if not key.endswith(".weight_packed"):
            continue
        module = key.removesuffix(".weight_packed")
        scale = tensors[module + ".weight_scale"]
        if scale.dtype == torch.float8_e4m3fn:
            scales = nvfp4_group_scales(scale, tensors[module + ".weight_global_scale"].float())
            out[module] = dequantize_fp4(packed, scales, 16)
        else:
            out[module] = dequantize_fp4(packed, mxfp4_group_scales(scale), 32)
    return out


def dense_oracle(hf_model: torch.nn.Module, quantized_path: str) -> torch.nn.Module:
    """``hf_model`` (float32) with every packed Linear's weight replaced by its decode (in place)."""
    decoded = decoded_weights(quantized_path)
    params: dict[str, Any] = dict(hf_model.named_parameters())
    for module, weight in decoded.items():
        params[module + ".weight"].data.copy_(weight)
    return hf_model
