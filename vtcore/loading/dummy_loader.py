"""``load_format="dummy"``: random weights from a seed, built on the model's device; only config.json needed.

Scaled so that activations stay O(1) through depth and greedy output depends on the input:
linear weights ~ N(0, 1/in_features), embeddings ~ N(0, 1), norms at their identity, biases 0.
"""
from __future__ import annotations

import math

import torch
from torch import nn

from vtcore.config import HFConfig
from vtcore.layers.embedding import EmbedInto
from vtcore.layers.linear import Linear
from vtcore.layers.norm import RMSNorm


@torch.no_grad()
def load_dummy(model: nn.Module, model_path: str, hf_config: HFConfig, seed: int) -> None:
    device = next(model.parameters()).device
    gen = torch.Generator(device=device).manual_seed(seed)
    done: set[int] = set()

    def normal(p: torch.Tensor, std: float) -> None:
        p.copy_(torch.randn(p.shape, generator=gen, device=device, dtype=torch.float32) * std)

    for module in model.modules():
        custom = getattr(module, "dummy_init", None)
        params = [p for p in module.parameters(recurse=False) if id(p) not in done]
        if callable(custom):
            custom(gen)
        elif isinstance(module, Linear):
            if module.quant is not None:
                module.quant_dummy_init(gen)
            else:
                normal(module.weight, 1.0 / math.sqrt(module.in_features))
            if module.bias is not None:
                module.bias.zero_()
        elif isinstance(module, EmbedInto):
            normal(module.weight, 1.0)
        elif isinstance(module, RMSNorm):
            module.weight.fill_(0.0 if module.zero_centered else 1.0)
        else:
            for p in params:
                normal(p, 0.02)
        done.update(id(p) for p in params)
