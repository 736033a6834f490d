"""FP4 weight-only quantization (compressed-tensors' NVFP4 and MXFP4 packed formats) for ``Linear`` layers.

The format plugins (``vtcore-quant-nvfp4``, ``vtcore-quant-mxfp4``) subclass ``FP4Method`` with their
group size and scale encoding. ``prepare`` takes over every targeted Linear before weights load:
its dense ``weight`` is replaced by ``weight_packed`` (uint8, two e2m1 codes per byte, low nibble =
even input column), ``weight_scale`` (one per group) and, for NVFP4, ``weight_global_scale``, one
per checkpoint shard of a fused projection. No dense copy of the weights is kept: the CPU path
decodes transiently inside the matmul; on CUDA the Triton kernel decodes in registers.

Targets and ignores are matched against checkpoint module names (a fused ``qkv_proj`` is checked as
its ``q_proj``/``k_proj``/``v_proj``), as class names (``Linear``), exact names, or ``re:`` regexes.
"""
from __future__ import annotations

import math
import re
from typing import Any

import torch
from torch import nn

from vtcore.errors import CheckpointError, NotSupportedError
from vtcore.layers.linear import Linear
from vtcore.quant.base import QuantMethod


def _matches(name: str, patterns: list[str]) -> bool:
    for pattern in patterns:
        if pattern.startswith("re:"):
            if re.match(pattern[3:], name):
                return True
        elif pattern in ("Linear", name):
            return True
    return False


def checkpoint_names(model: nn.Module, name: str, layer: Linear) -> list[str]:
    """The checkpoint module name behind each shard of ``layer`` (inverting ``packed_modules_mapping``)."""
    reverse = {(fused, shard): part for part, (fused, shard) in getattr(model, "packed_modules_mapping", {}).items()}
    parts = name.split(".")
    names = []
    for shard in layer.shard_names:
        i = next((i for i, p in enumerate(parts) if (p, shard) in reverse), None)
        names.append(name if i is None else ".".join(parts[:i] + [reverse[(parts[i], shard)]] + parts[i + 1:]))
    return names


class FP4Method(QuantMethod):
    """A compressed-tensors FP4 pack-quantized format; subclasses set the class attributes."""

    format: str = ""
    group_size: int = 0
    scale_dtype: torch.dtype = torch.uint8
    scale_kind: str = ""  # "e4m3" or "e8m0"
    has_global_scale: bool = False

    def __init__(self, quant_config: dict[str, Any]) -> None:
        super().__init__(quant_config)
        if quant_config.get("kv_cache_scheme") is not None:
            raise NotSupportedError(f"quantization_config.kv_cache_scheme={quant_config['kv_cache_scheme']!r}: "
                                    "a quantized KV cache is not supported; expected null")
        self.ignore: list[str] = list(quant_config.get("ignore") or [])
        self.targets: list[str] = []
        for gname, group in (quant_config.get("config_groups") or {}).items():
            weights = group.get("weights") or {}
            want = {"num_bits": 4, "type": "float", "group_size": self.group_size}
            got = {k: weights.get(k) for k in want}
            if got != want:
                raise CheckpointError(f"quantization_config.config_groups.{gname}.weights: {got}, expected {want} "
                                      f"for format {self.format!r}")
            if group.get("input_activations"):
                raise NotSupportedError(f"quantization_config.config_groups.{gname}.input_activations="
                                        f"{group['input_activations']!r}: activation quantization (W4A4) is not "
                                        "implemented yet; weight-only (A16) checkpoints load")
            self.targets += list(group.get("targets") or [])
        if not self.targets:
            raise CheckpointError(f"quantization_config has no config_groups with targets for format {self.format!r}")

    def prepare(self, model: nn.Module) -> None:
        for name, module in list(model.named_modules()):
            if callable(getattr(module, "fp4_take_over", None)):
                # Non-Linear weights a family packs itself (MoE experts): it gets the method and the
                # matcher, and decides per expert projection.
                module.fp4_take_over(self, name, lambda n: _matches(n, self.targets) and not _matches(n, self.ignore))
                continue
            if not isinstance(module, Linear):
                continue
            names = checkpoint_names(model, name, module)
            chosen = [_matches(n, self.targets) and not _matches(n, self.ignore) for n in names]
            if not any(chosen):
                continue
            if not all(chosen):
                raise CheckpointError(f"{name}: fuses {names}, of which only {[n for n, c in zip(names, chosen) if c]} "
                                      "are quantized; a fused projection must be quantized whole")
            if module.in_features % self.group_size:
                raise CheckpointError(f"{name}: in_features={module.in_features} is not divisible by the "
                                      f"{self.format} group size {self.group_size}")
            self._take_over(module)

    def _take_over(self, layer: Linear) -> None:
        device = layer.weight.device
        out, inp = layer.out_features, layer.in_features
        layer.weight = None
        layer.weight_packed = layer.new_param(torch.empty(out, inp // 2, dtype=torch.uint8, device=device),
                                              exact_dtype=True)
        layer.weight_scale = layer.new_param(
            torch.empty(out, inp // self.group_size, dtype=self.scale_dtype, device=device), exact_dtype=True)
        if self.has_global_scale:
            layer.weight_global_scale = layer.new_param(
                torch.empty(len(layer.shard_names), dtype=torch.float32, device=device), per_shard=True,
                exact_dtype=True)
            sizes = [s.stop - s.start for s in layer.shard_slices.values()] or [out]
            row_shard = torch.repeat_interleave(torch.arange(len(sizes)), torch.tensor(sizes))
            layer.register_buffer("row_shard", row_shard.to(device), persistent=False)
        layer.quant = self

    def apply(self, layer: Linear, x: torch.Tensor) -> torch.Tensor:
        row_global = layer.weight_global_scale[layer.row_shard] if self.has_global_scale else None
        if x.is_cuda:
            from vtcore.kernels.fp4_gemm import fp4_matmul

            return fp4_matmul(x, layer.weight_packed, layer.weight_scale.view(torch.uint8), self.scale_kind,
                              row_global, self.group_size, layer.bias)
        from vtcore.quant.fp4 import fp4_linear_reference

        return fp4_linear_reference(x, layer.weight_packed, layer.weight_scale, self.scale_kind, row_global,
                                    self.group_size, layer.bias)

    @torch.no_grad()
    def dummy_init(self, layer: Linear, gen: torch.Generator) -> None:
        """Random codes; scales of the checkpoint's dtypes chosen so the weights' rms is about 1/sqrt(in)."""
        device = layer.weight_packed.device
        layer.weight_packed.copy_(torch.randint(0, 256, layer.weight_packed.shape, generator=gen, device=device,
                                                dtype=torch.int32).to(torch.uint8))
        scale = 1.0 / (2.93 * math.sqrt(layer.in_features))  # e2m1 codes drawn uniformly have rms 2.93
        if self.has_global_scale:
            layer.weight_global_scale.fill_(64.0)  # lifts the fp8 scales out of e4m3's subnormal range
            layer.weight_scale.copy_(torch.full(layer.weight_scale.shape, scale * 64.0, device=device)
                                     .to(self.scale_dtype))
        else:
            layer.weight_scale.fill_(round(math.log2(scale)) + 127)
        if layer.bias is not None:
            layer.bias.zero_()
