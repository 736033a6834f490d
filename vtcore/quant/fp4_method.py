"""FP4 weight-only quantization (compressed-tensors' NVFP4 and MXFP4 packed formats) for ``Linear`` layers.

The format plugins (``vtcore-quant-nvfp4``, ``vtcore-quant-mxfp4``) subclass ``FP4Method`` with their
group size and scale encoding. ``prepare`` takes over every targeted Linear before weights load:
its dense ``weight`` is replaced by ``weight_packed`` (uint8, two e2m1 codes per byte, low nibble =
even input column), ``weight_scale`` (one per group) and, for NVFP4, ``weight_global_scale``, one
per checkpoint shard of a fused projection. No dense copy of the weights is kept: the CPU path
decodes transiently inside the matmul; on CUDA the Triton kernel decodes in registers.

Targets and ignores are matched against checkpoint module names (a fused ``qkv_proj`` is checked as
its ``q_proj``/``k_proj``/``v_proj``), as class names (``Linear``), exact names, or ``re:`` regexes.

W4A4 (config groups with ``input_activations``): ``apply`` fake-quantizes the Linear's input
(``vtcore.quant.fp4_activations``, compressed-tensors' dynamic per-group e2m1 quantize-dequantize)
before the weight-only path, on CPU and CUDA alike. NVFP4 also loads a static float32
``input_global_scale`` per checkpoint shard; the shards of a fused projection see one input, so
they must carry one value (compressed-tensors/llm-compressor calibrate them on the same tensor);
different values are refused at load (vLLM would silently take their maximum).
"""
from __future__ import annotations

import math
import re
from typing import Any

import torch
from torch import nn

from vtcore.errors import CheckpointError, NotSupportedError
from vtcore.kernels.fp4 import FP4Weight, dequantize_fp4, fp4_linear_reference, group_scales
from vtcore.layers.linear import Linear
from vtcore.quant.base import QuantMethod
from vtcore.quant.fp4_activations import fake_quantize_mxfp4_input, fake_quantize_nvfp4_input


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


#: The ``input_activations`` of a W4A4 group, per scale kind (compressed-tensors' NVFP4 / MXFP4 presets):
#: NVFP4 quantizes inputs per 16 with e4m3 scales, dynamic but for the static global scale; MXFP4 per
#: 32 with e8m0 scales, fully dynamic. Any other value is refused, naming the field.
INPUT_ACTIVATIONS: dict[str, dict[str, Any]] = {
    "e4m3": {"num_bits": 4, "type": "float", "group_size": 16, "dynamic": "local", "strategy": "tensor_group",
             "symmetric": True, "scale_dtype": "torch.float8_e4m3fn"},
    "e8m0": {"num_bits": 4, "type": "float", "group_size": 32, "dynamic": True, "strategy": "group",
             "symmetric": True, "scale_dtype": "torch.uint8"},
}
#: The weights' ``strategy`` per scale kind (NVFP4: a global scale over the groups; MXFP4: groups only).
WEIGHT_STRATEGY = {"e4m3": "tensor_group", "e8m0": "group"}
#: Fields a checkpoint may leave out (or null): older compressed-tensors wrote no scale_dtype.
_OPTIONAL_INPUT_FIELDS = ("strategy", "symmetric", "scale_dtype")


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
        # Sparsity and transforms change the math (ignored, the weights would load wrong); the no-op
        # forms compressed-tensors writes for other models ("dense" with no targets, no groups) pass.
        sparsity, transform = quant_config.get("sparsity_config") or {}, quant_config.get("transform_config") or {}
        if sparsity.get("format", "dense") != "dense" and sparsity.get("targets", ["?"]):
            raise NotSupportedError(f"quantization_config.sparsity_config={sparsity!r}: sparse weights are not "
                                    "supported; expected null or format 'dense'")
        if transform.get("config_groups", transform):
            raise NotSupportedError(f"quantization_config.transform_config={transform!r}: weight transforms are "
                                    "not supported; expected null or no config_groups")
        self.ignore: list[str] = list(quant_config.get("ignore") or [])
        self.targets: list[str] = []
        self.quantize_inputs = False  # W4A4: every group has input_activations
        seen_groups = False
        for gname, group in (quant_config.get("config_groups") or {}).items():
            weights = group.get("weights") or {}
            want = {"num_bits": 4, "type": "float", "group_size": self.group_size}
            got = {k: weights.get(k) for k in want}
            # strategy and symmetric as the format writes them (older checkpoints may leave them out)
            for field, expected in (("strategy", WEIGHT_STRATEGY[self.scale_kind]), ("symmetric", True)):
                if weights.get(field) not in (None, expected):
                    want[field], got[field] = expected, weights[field]
            if got != want:
                raise CheckpointError(f"quantization_config.config_groups.{gname}.weights: {got}, expected {want} "
                                      f"for format {self.format!r}")
            acts = group.get("input_activations")
            if acts:
                want_in = INPUT_ACTIVATIONS[self.scale_kind]
                for field, expected in want_in.items():
                    if acts.get(field) is None and field in _OPTIONAL_INPUT_FIELDS:
                        continue
                    if acts.get(field) != expected:
                        raise NotSupportedError(
                            f"quantization_config.config_groups.{gname}.input_activations.{field}="
                            f"{acts.get(field)!r}: expected {expected!r} for W4A4 format {self.format!r} "
                            f"(input_activations {want_in})")
            if seen_groups and bool(acts) != self.quantize_inputs:
                raise NotSupportedError(f"quantization_config.config_groups.{gname}: mixes weight-only and W4A4 "
                                        "config groups; expected every group with input_activations or none")
            self.quantize_inputs = bool(acts)
            seen_groups = True
            self.targets += list(group.get("targets") or [])
        if not self.targets:
            raise CheckpointError(f"quantization_config has no config_groups with targets for format {self.format!r}")

    def prepare(self, model: nn.Module) -> None:
        for name, module in list(model.named_modules()):
            if callable(getattr(module, "fp4_take_over", None)):
                # Non-Linear weights a family packs itself (MoE experts): it gets the method and the
                # matcher, and decides per expert projection. Under W4A4 it must also quantize their
                # inputs (``quantize_input``) and say so with ``fp4_quantizes_inputs = True``.
                targeted: list[str] = []

                def is_targeted(n: str) -> bool:
                    hit = _matches(n, self.targets) and not _matches(n, self.ignore)
                    if hit:
                        targeted.append(n)
                    return hit

                module.fp4_take_over(self, name, is_targeted)
                if targeted and self.quantize_inputs and not getattr(module, "fp4_quantizes_inputs", False):
                    raise NotSupportedError(f"{name}: {type(module).__name__} packs {targeted[0]} (and its other "
                                            "targeted projections) without quantizing their inputs; W4A4 "
                                            "(input_activations) is implemented for Linear layers only; "
                                            "expected a weight-only (A16) checkpoint")
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
            layer.weight_global_scale.weight_loader = _uncaching_loader(layer, layer.weight_loader)
            sizes = [s.stop - s.start for s in layer.shard_slices.values()] or [out]
            row_shard = torch.repeat_interleave(torch.arange(len(sizes)), torch.tensor(sizes))
            layer.register_buffer("row_shard", row_shard.to(device), persistent=False)
        if self.quantize_inputs and self.has_global_scale:
            layer.input_global_scale = layer.new_param(
                torch.full((len(layer.shard_names),), float("nan"), dtype=torch.float32, device=device),
                per_shard=True, exact_dtype=True)
            layer.input_global_scale.weight_loader = _shared_scale_loader(layer)
        layer.quant = self

    def quantize_input(self, x: torch.Tensor, input_global_scale: torch.Tensor | None = None) -> torch.Tensor:
        """``x`` fake-quantized as this format's W4A4 input (unchanged for A16); NVFP4 needs the global scale."""
        if not self.quantize_inputs:
            return x
        if self.has_global_scale:
            return fake_quantize_nvfp4_input(x, input_global_scale)
        return fake_quantize_mxfp4_input(x)

    def decode_weight(self, tensors: dict[str, torch.Tensor]) -> torch.Tensor:
        """The float32 dense weight of one Linear's checkpoint tensors (``weight_packed``,
        ``weight_scale`` and, for NVFP4, ``weight_global_scale``): the conformance gate holds this to
        compressed-tensors' own decompress."""
        glob = tensors["weight_global_scale"].float() if self.has_global_scale else None
        scales = group_scales(tensors["weight_scale"], self.scale_kind, glob)
        return dequantize_fp4(tensors["weight_packed"], scales, self.group_size)

    def fp4_weight(self, layer: Linear) -> FP4Weight:
        """``layer``'s packed weight with a float32 global scale per output row (NVFP4), cached on the
        layer (no gather launch per call) until its global scales change: a load through their
        ``weight_loader`` drops the cache, an in-place op on the parameter bumps its version."""
        if not self.has_global_scale:
            return FP4Weight(layer.weight_packed, layer.weight_scale.view(torch.uint8), self.scale_kind,
                             self.group_size)
        version = layer.weight_global_scale._version
        cached = getattr(layer, "_fp4_weight", None)
        if (cached is None or cached[0] != version or cached[1].packed is not layer.weight_packed
                or cached[1].row_global.device != layer.weight_packed.device):
            weight = FP4Weight(layer.weight_packed, layer.weight_scale.view(torch.uint8), self.scale_kind,
                               self.group_size, layer.weight_global_scale[layer.row_shard].contiguous())
            layer._fp4_weight = cached = (version, weight)
        return cached[1]

    def gemv_weight(self, layer: Linear) -> FP4Weight | None:
        """W4A16 layers decode through the FP4 GEMV; W4A4 ones quantize their input first (``apply``)."""
        return None if self.quantize_inputs else self.fp4_weight(layer)

    def apply(self, layer: Linear, x: torch.Tensor) -> torch.Tensor:
        w = self.fp4_weight(layer)
        if self.quantize_inputs:  # shards share one value (checked at load): a float32 [1]
            x = self.quantize_input(x, layer.input_global_scale[:1] if self.has_global_scale else None)
        if x.is_cuda:
            from vtcore.kernels.fp4_gemm import fp4_matmul

            return fp4_matmul(x, w.packed, w.scale, self.scale_kind, w.row_global, self.group_size, layer.bias)
        return fp4_linear_reference(x, w.packed, w.scale, self.scale_kind, w.row_global, self.group_size,
                                    layer.bias)

    @torch.no_grad()
    def dummy_init(self, layer: Linear, gen: torch.Generator) -> None:
        """Random codes; scales of the checkpoint's dtypes chosen so the weights' rms is about 1/sqrt(in)."""
        device = layer.weight_packed.device
        layer.weight_packed.copy_(torch.randint(0, 256, layer.weight_packed.shape, generator=gen, device=device,
                                                dtype=torch.int32).to(torch.uint8))
        scale = 1.0 / (2.93 * math.sqrt(layer.in_features))  # e2m1 codes drawn uniformly have rms 2.93
        if self.has_global_scale:
            layer.weight_global_scale.fill_(64.0)  # lifts the fp8 scales out of e4m3's subnormal range
            if self.quantize_inputs:
                # as calibrated for inputs of |x| <= 8 (generate_gparam: 448 * 6 / amax): dummy
                # activations are O(1), so their group scales land in e4m3's normal range
                layer.input_global_scale.fill_(448.0 * 6.0 / 8.0)
            layer.weight_scale.copy_(torch.full(layer.weight_scale.shape, scale * 64.0, device=device)
                                     .to(self.scale_dtype))
        else:
            layer.weight_scale.fill_(round(math.log2(scale)) + 127)
        if layer.bias is not None:
            layer.bias.zero_()


def _uncaching_loader(layer: Linear, load: Any) -> Any:
    """``load``, then drop the layer's cached per-row global scales (the loader writes through
    ``param.data``, which leaves the parameter's version unchanged)."""
    def loader(param: nn.Parameter, loaded: torch.Tensor, shard: str | None = None) -> None:
        load(param, loaded, shard)
        layer.__dict__.pop("_fp4_weight", None)
    return loader


def _shared_scale_loader(layer: Linear):
    """Load one shard's ``input_global_scale``, refusing a value that differs from a shard already loaded."""
    def load(param: nn.Parameter, loaded: torch.Tensor, shard: str | None = None) -> None:
        layer.weight_loader(param, loaded, shard)
        values = param.data[~torch.isnan(param.data)]
        if values.numel() and not bool((values == values[0]).all()):
            shown = {n: float(v) for n, v in zip(layer.shard_names, param.data.tolist()) if v == v}
            raise ValueError(f"value {float(loaded.reshape(-1)[0])!r} while the fused shards loaded so far hold "
                             f"{shown}: the shards of a fused projection share one input, so one "
                             "input_global_scale is expected")
    return load
