"""NVFP4: e2m1 codes, one fp8 e4m3 scale per 16 inputs, and a float32 global scale per (shard of a) Linear.

Decoded weight = code * (float(weight_scale) / weight_global_scale), the scale divided first.
"""
from __future__ import annotations

import torch

from vtcore.quant.fp4_method import FP4Method


class NVFP4Method(FP4Method):
    format = "nvfp4-pack-quantized"
    group_size = 16
    scale_dtype = torch.float8_e4m3fn
    scale_kind = "e4m3"
    has_global_scale = True
