"""The token oracle of a packed FP4 checkpoint: the dense float32 HF model of its decoded weights.

vtcore's float32 decode is checked bit for bit (rounded to bf16) against compressed-tensors'
``decompress`` in tests/test_fp4.py; this builds the dense model from that decode, so greedy
tokens of the quantized engine can be held to the near-tie rule.

MoE experts are packed per expert (``<experts>.<e>.gate_proj|up_proj|down_proj``) while transformers
holds them fused in memory (``<experts>.gate_up_proj`` [E, 2I, H], gate rows then up rows, and
``<experts>.down_proj`` [E, H, I]): ``expert_weight_view`` finds the slice each decode fills.
"""
from __future__ import annotations

import os
import re
from typing import Any

import torch
from safetensors import safe_open

from vtcore.kernels.fp4 import dequantize_fp4, mxfp4_group_scales, nvfp4_group_scales


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


_PER_EXPERT = re.compile(r"^(.*\.experts)\.(\d+)\.(gate|up|down)_proj$")


def expert_weight_view(params: dict[str, Any], module: str) -> torch.Tensor | None:
    """The part of transformers' fused 3-D expert parameters that the per-expert checkpoint module
    ``module`` (``model.layers.0.mlp.experts.3.up_proj``) holds, as a view (``[I, H]`` or ``[H, I]``);
    None when ``module`` is not a per-expert name or the model has no fused experts there."""
    match = _PER_EXPERT.match(module)
    if match is None:
        return None
    experts, e, proj = match[1], int(match[2]), match[3]
    fused = params.get(f"{experts}.{'down_proj' if proj == 'down' else 'gate_up_proj'}")
    if fused is None or fused.ndim != 3:
        return None
    if proj == "down":
        return fused.data[e]
    inter = fused.shape[1] // 2
    return fused.data[e, :inter] if proj == "gate" else fused.data[e, inter:]


def dense_oracle(hf_model: torch.nn.Module, quantized_path: str) -> torch.nn.Module:
    """``hf_model`` (float32) with every packed Linear's weight, and every packed expert's slice of
    the fused expert parameters, replaced by its decode (in place)."""
    decoded = decoded_weights(quantized_path)
    params: dict[str, Any] = dict(hf_model.named_parameters())
    for module, weight in decoded.items():
        target = params[module + ".weight"].data if module + ".weight" in params else \
            expert_weight_view(params, module)
        if target is None:
            raise KeyError(f"{quantized_path}: packed {module!r} has no weight in {type(hf_model).__name__} "
                           "(neither a Linear nor a fused expert)")
        if tuple(target.shape) != tuple(weight.shape):
            raise ValueError(f"{module}: decoded weight {tuple(weight.shape)}, model has {tuple(target.shape)}")
        target.copy_(weight)
    return hf_model
