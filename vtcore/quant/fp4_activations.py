"""W4A4 input (activation) fake quantization: NVFP4 and MXFP4, as compressed-tensors computes it.

A W4A4 Linear quantizes its input to e2m1 per group of input columns (dynamically, from the group's
absolute maximum) and dequantizes it again before the matmul; the result has ``x``'s dtype and
shape. These functions reproduce compressed-tensors 0.20.1's fake quantization bit for bit (float32,
bfloat16 and float16 inputs), op by op in the same dtypes, without importing it:

``quantization/lifecycle/forward.py::forward_quantize`` (dynamic: ``compute_dynamic_scales_and_zp``,
then ``fake_quantize`` -> ``forward_helpers.py::_process_group`` -> ``_quantize_dequantize``), with
the scales from ``quantization/utils/helpers.py::calculate_qparams``:

* **NVFP4** (``strategy tensor_group, group_size 16, dynamic "local", scale_dtype float8_e4m3fn``;
  the static ``input_global_scale`` is a float32 ``[1]`` checkpoint tensor)::

      a   = max(|min(x_g, 0)|, |max(x_g, 0)|)      # = amax |x_g|, in x's dtype
      s   = a / (bit_range.to(x.dtype) / 2)         # a / 6, in x's dtype
      s   = global_scale * s                        # float32 [1] * s -> float32
      s   = clamp(s, -448, 448).to(e4m3).float()    # round_to_quantized_type_dtype
      s   = where(s == 0, 0.125, s)                 # _get_dtype_eps(float8_e4m3fn)
      s   = s / global_scale                        # _quantize_dequantize, float32
      q   = cast_to_fp4(clamp(x_g / s + 0, -6, 6))  # float32 (x_g / s promotes); + the e4m3 zero point
      y   = ((q - 0) * s).to(x.dtype)               # the zero point again; one rounding to x's dtype

  (``global_scale`` must stay a 1-element *1-D* tensor: a 0-dim one would keep ``global_scale * s``
  in x's dtype under torch's promotion rules.)
* **MXFP4** (``strategy group, group_size 32, dynamic true, scale_dtype uint8``; nothing stored;
  ``utils/mxfp_utils.py::generate_mx_scales`` / ``round_to_power_2`` / ``maybe_convert_from_mx_exp``)::

      a   = amax |x_g|                                        # in x's dtype
      p   = bits(a) + (1 << (mantissa_bits - 2)), masked to sign+exponent  # round_to_power_2:
                                                              # up to 2^(e+1) iff the significand >= 1.75
      e   = 127 + floor(log2(p)) - 2                          # in x's dtype (0 -> -inf)
      e   = round(clamp(e, 0, 255)).to(uint8)                 # round_to_quantized_type_dtype
      s   = (2.0 ** (e.int32 - 127).float()).to(x.dtype)      # e = 255 -> inf
      s   = where(s == 0, 1, s)                               # _get_dtype_eps(uint8) = 1
      q   = cast_to_fp4(clamp(x_g / s + 0, -6, 6))            # all in x's dtype
      y   = (q - 0) * s                                       # in x's dtype

* ``cast_to_fp4`` (``quantization/utils/fp4_utils.py``, the torch path): ``sign(x) * m`` where ``m``
  rounds ``|x|`` to {0, .5, 1, 1.5, 2, 3, 4, 6}, ties to the even code (.25 -> 0, .75 -> 1,
  1.25 -> 1, 1.75 -> 2, 2.5 -> 2, 3.5 -> 4, 5 -> 4).
"""
from __future__ import annotations

import torch

__all__ = ["NVFP4_INPUT_GROUP", "MXFP4_INPUT_GROUP", "cast_to_fp4", "fake_quantize_nvfp4_input",
           "fake_quantize_mxfp4_input"]

NVFP4_INPUT_GROUP = 16
MXFP4_INPUT_GROUP = 32

# (mantissa bits, exponent bits) of the float dtypes round_to_power_2 handles.
_FLOAT_BITS = {torch.float32: (23, 8), torch.bfloat16: (7, 8), torch.float16: (10, 5)}


def cast_to_fp4(x: torch.Tensor) -> torch.Tensor:
    """Round to the nearest e2m1 value (ties to even), keeping ``x``'s dtype; ``sign(x) * |x| rounded``."""
    a = x.abs()
    m = torch.where(a > 5.0, 6.0, 4.0)
    m = torch.where(a < 3.5, 3.0, m)
    m = torch.where(a <= 2.5, 2.0, m)
    m = torch.where(a < 1.75, 1.5, m)
    m = torch.where(a <= 1.25, 1.0, m)
    m = torch.where(a < 0.75, 0.5, m)
    m = torch.where(a <= 0.25, 0.0, m).to(x.dtype)
    m = torch.where(torch.isnan(a), a, m)
    return m * torch.sign(x)


def _groups(x: torch.Tensor, group_size: int) -> torch.Tensor:
    if not x.is_floating_point() or x.dtype not in _FLOAT_BITS:
        raise TypeError(f"activation fake quantization needs a float32, bfloat16 or float16 input, got {x.dtype}")
    if x.ndim == 0 or x.shape[-1] % group_size:
        raise ValueError(f"input's last dimension {tuple(x.shape)[-1:]} is not a multiple of the group size "
                         f"{group_size}")
    return x.unflatten(-1, (x.shape[-1] // group_size, group_size))


def _group_amax(xg: torch.Tensor) -> torch.Tensor:
    # calculate_qparams' max(|min(amin, 0)|, |max(amax, 0)|), in x's dtype
    lo = torch.clamp(xg.amin(-1), max=0.0)
    hi = torch.clamp(xg.amax(-1), min=0.0)
    return torch.maximum(lo.abs(), hi.abs())


@torch.no_grad()
def fake_quantize_nvfp4_input(x: torch.Tensor, input_global_scale: torch.Tensor) -> torch.Tensor:
    """NVFP4 W4A4 input fake quantization of ``x`` ``[..., K]`` (K a multiple of 16); same dtype and shape.

    ``input_global_scale`` is the Linear's static float32 global scale (one value; the group scale is
    divided by it).
    """
    if x.numel() == 0:
        return x
    gs = input_global_scale.to(device=x.device, dtype=torch.float32).reshape(1)
    xg = _groups(x, NVFP4_INPUT_GROUP)
    six = torch.tensor(6.0, dtype=x.dtype, device=x.device)
    s = gs * (_group_amax(xg) / six)  # float32
    s = torch.clamp(s, -448.0, 448.0).to(torch.float8_e4m3fn).to(torch.float32)
    s = torch.where(s == 0, 0.125, s)
    s = (s / gs).unsqueeze(-1)
    scaled = xg / s + 0.0
    q = cast_to_fp4(torch.clamp(scaled, -6.0, 6.0))
    return ((q - 0.0) * s).flatten(-2).to(x.dtype)


@torch.no_grad()
def fake_quantize_mxfp4_input(x: torch.Tensor) -> torch.Tensor:
    """MXFP4 W4A4 input fake quantization of ``x`` ``[..., K]`` (K a multiple of 32); same dtype and shape."""
    if x.numel() == 0:
        return x
    xg = _groups(x, MXFP4_INPUT_GROUP)
    amax = _group_amax(xg)
    mant, expo = _FLOAT_BITS[x.dtype]
    width = 32 if x.dtype == torch.float32 else 16
    signed = torch.int32 if width == 32 else torch.int16
    bits = amax.view(signed).to(torch.int64) & ((1 << width) - 1)  # the unsigned bit pattern
    bits = (bits + (1 << (mant - 2))) & (((1 << (expo + 1)) - 1) << mant)
    bits = bits & ((1 << width) - 1)
    bits = torch.where(bits >= 1 << (width - 1), bits - (1 << width), bits)  # back to the signed type
    p = bits.to(signed).view(x.dtype)
    e = 127 + torch.floor(torch.log2(p)) - 2
    e = torch.round(torch.clamp(e, 0, 255)).to(torch.uint8).to(x.dtype)
    s = (2.00 ** ((e.to(torch.int32) - 127).to(torch.float))).to(x.dtype)
    s = torch.where(s == 0, torch.ones((), dtype=x.dtype, device=x.device), s).unsqueeze(-1)
    scaled = xg / s + 0.0
    q = cast_to_fp4(torch.clamp(scaled, -6.0, 6.0))
    return ((q - 0.0) * s).flatten(-2).to(x.dtype)
