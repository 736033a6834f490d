"""MXFP4: e2m1 codes and one uint8 e8m0 scale (2^(b-127)) per 32 inputs; no global scale."""
from __future__ import annotations

import torch

from vtcore.quant.fp4_method import FP4Method


class MXFP4Method(FP4Method):
    format = "mxfp4-pack-quantized"
    group_size = 32
    scale_dtype = torch.uint8
    scale_kind = "e8m0"
    has_global_scale = False
