"""FP4 quantization (compressed-tensors' NVFP4 and MXFP4 packed formats), a :class:`QuantMethod` for
every quantizable layer (``Linear``, the MoE ``Experts``).

The format plugins (``vtcore-quant-nvfp4``, ``vtcore-quant-mxfp4``) subclass ``FP4Method`` with their
group size and scale encoding. A targeted weight is held as ``weight_packed`` (uint8, two e2m1 codes
per byte, low nibble = even input column), ``weight_scale`` (one per group) and, for NVFP4,
``weight_global_scale``, one per checkpoint shard of a fused projection (of each expert, for a
stack). No dense copy of the weights is kept: the CPU path decodes transiently inside the matmul;
on CUDA the Triton kernels decode in registers (the GEMV at decode sizes, the tile GEMM, the fused MoE).

Targets and ignores are matched against checkpoint module names (a fused ``qkv_proj`` is checked as
its ``q_proj``/``k_proj``/``v_proj``, stacked experts as ``experts.N.gate_proj`` ...), as class names
(``Linear``), exact names, or ``re:`` regexes.

W4A4 (config groups with ``input_activations``): ``apply`` fake-quantizes the matrix's input
(``vtcore.quant.fp4_activations``, compressed-tensors' dynamic per-group e2m1 quantize-dequantize)
before the weight-only path, on CPU and CUDA alike. NVFP4 also loads a static float32
``input_global_scale`` per checkpoint shard; the shards of a fused projection (an expert's gate and
up) see one input, so they must carry one value (compressed-tensors/llm-compressor calibrate them on the same tensor);
different values are refused at load (vLLM would silently take their maximum).
"""
from __future__ import annotations

import math
import re
from typing import Any

import torch

from vtcore.errors import CheckpointError, NotSupportedError
from vtcore.kernels.fp4 import FP4Weight, dequantize_fp4, fp4_linear_reference, group_scales
from vtcore.quant.base import QuantMethod, QuantTensor, QuantWeights, WeightSpec
from vtcore.quant.fp4_activations import fake_quantize_mxfp4_input, fake_quantize_nvfp4_input


def _matches(name: str, patterns: list[str]) -> bool:
    for pattern in patterns:
        if pattern.startswith("re:"):
            if re.match(pattern[3:], name):
                return True
        elif pattern in ("Linear", name):
            return True
    return False


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

    def quantizes(self, module: str) -> bool:
        """Targeted and not ignored; a module under an ignored one (the experts of an ignored
        ``mlp.experts``, as ``vtcore quantize`` lists experts it left dense) is ignored too."""
        parts = module.split(".")
        ancestors = [".".join(parts[:i]) for i in range(1, len(parts))]
        return _matches(module, self.targets) and not any(_matches(n, self.ignore) for n in [module, *ancestors])

    def create_weights(self, spec: WeightSpec, device: torch.device) -> dict[str, QuantTensor]:
        """``weight_packed`` uint8 ``[*lead, rows, in/2]``, ``weight_scale`` ``[*lead, rows, in/group]``
        and, for NVFP4, float32 ``weight_global_scale`` ``[*lead, shards]`` (W4A4: and the static
        ``input_global_scale`` ``[*lead, shards]``, one value shared by the shards)."""
        if spec.in_features % self.group_size:
            raise CheckpointError(f"{spec.name}: in_features={spec.in_features} is not divisible by the "
                                  f"{self.format} group size {self.group_size}")
        lead, rows, k, n = spec.lead, spec.rows, spec.in_features, len(spec.shards)
        tensors = {
            "weight_packed": QuantTensor(torch.empty(*lead, rows, k // 2, dtype=torch.uint8, device=device)),
            "weight_scale": QuantTensor(torch.empty(*lead, rows, k // self.group_size, dtype=self.scale_dtype,
                                                    device=device)),
        }
        if self.has_global_scale:
            tensors["weight_global_scale"] = QuantTensor(torch.empty(*lead, n, dtype=torch.float32, device=device),
                                                         per_shard=True)
            if self.quantize_inputs:
                tensors["input_global_scale"] = QuantTensor(
                    torch.full((*lead, n), float("nan"), dtype=torch.float32, device=device), per_shard=True,
                    shared=True)
        return tensors

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

    def fp4_weight(self, weights: QuantWeights) -> FP4Weight:
        """One matrix's packed weight with a float32 global scale per output row (NVFP4), cached in
        ``weights.cache`` (no gather launch per call) until its global scales change: a load through
        the layer's loaders empties the cache, an in-place op on the parameter bumps its version."""
        packed, scale = weights["weight_packed"], weights["weight_scale"].view(torch.uint8)
        if not self.has_global_scale:
            return FP4Weight(packed, scale, self.scale_kind, self.group_size)
        glob = weights["weight_global_scale"]
        cached = weights.cache.get("fp4")
        if (cached is None or cached[0] != glob._version or cached[1].packed is not packed
                or cached[1].row_global.device != packed.device):  # Module.to() moves data in place
            sizes = torch.tensor([n for _, n in weights.spec.shards])
            rows = torch.repeat_interleave(torch.arange(len(sizes)), sizes).to(glob.device)
            weight = FP4Weight(packed, scale, self.scale_kind, self.group_size, glob[rows].contiguous())
            if weights.index is not None:  # a view of one expert: built per call (the CPU loop)
                return weight
            weights.cache["fp4"] = cached = (glob._version, weight)
        return cached[1]

    def gemv_weight(self, weights: QuantWeights) -> FP4Weight | None:
        """W4A16 matrices decode through the FP4 GEMV; W4A4 ones quantize their input first (``apply``)."""
        return None if self.quantize_inputs or weights.spec.lead else self.fp4_weight(weights)

    def apply(self, weights: QuantWeights, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        w = self.fp4_weight(weights)
        if self.quantize_inputs:  # the shards share one value (checked at load): a float32 [1]
            x = self.quantize_input(x, weights["input_global_scale"][:1] if self.has_global_scale else None)
        if use_fp4_kernel(x):
            from vtcore.kernels.fp4_gemm import fp4_matmul

            return fp4_matmul(x, w.packed, w.scale, self.scale_kind, w.row_global, self.group_size, bias)
        return fp4_linear_reference(x, w.packed, w.scale, self.scale_kind, w.row_global, self.group_size, bias)

    def experts_operand(self, gate_up: QuantWeights, down: QuantWeights) -> object | None:
        """The fused MoE's packed operand (W4A16; W4A4 experts loop through ``apply``)."""
        if self.quantize_inputs:
            return None
        from vtcore.kernels.fused_moe import FP4Experts

        glob = (gate_up["weight_global_scale"], down["weight_global_scale"]) if self.has_global_scale \
            else (None, None)
        return FP4Experts(gate_up["weight_packed"], gate_up["weight_scale"], down["weight_packed"],
                          down["weight_scale"], self.scale_kind, self.group_size, *glob)

    @torch.no_grad()
    def dummy_init(self, weights: QuantWeights, gen: torch.Generator) -> None:
        """Random codes; scales of the checkpoint's dtypes chosen so the weights' rms is about 1/sqrt(in)."""
        packed, scales = weights["weight_packed"], weights["weight_scale"]
        device = packed.device
        packed.copy_(torch.randint(0, 256, packed.shape, generator=gen, device=device,
                                   dtype=torch.int32).to(torch.uint8))
        scale = 1.0 / (2.93 * math.sqrt(weights.spec.in_features))  # e2m1 codes drawn uniformly have rms 2.93
        if self.has_global_scale:
            weights["weight_global_scale"].fill_(64.0)  # lifts the fp8 scales out of e4m3's subnormal range
            if self.quantize_inputs:
                # as calibrated for inputs of |x| <= 8 (generate_gparam: 448 * 6 / amax): dummy
                # activations are O(1), so their group scales land in e4m3's normal range
                weights["input_global_scale"].fill_(448.0 * 6.0 / 8.0)
            scales.copy_(torch.full(scales.shape, scale * 64.0, device=device).to(self.scale_dtype))
        else:
            scales.fill_(round(math.log2(scale)) + 127)
        weights.invalidate()


def use_fp4_kernel(x: torch.Tensor) -> bool:
    """Packed weights run the Triton FP4 kernel on CUDA and the float32 torch reference elsewhere
    (a test may point this at the kernel under TRITON_INTERPRET on CPU)."""
    return x.is_cuda
