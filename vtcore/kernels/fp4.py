"""FP4 (NVFP4 / MXFP4) packed weights as the kernels take them (``FP4Weight``), and their float32
torch decode: the reference of ``fp4_gemm``, the FP4 GEMV and the fused MoE's FP4 path, and the CPU
path of the FP4 quant methods. Pure torch: importing it imports no Triton.

Checkpoint layout (compressed-tensors ``nvfp4-pack-quantized`` / ``mxfp4-pack-quantized``):

* ``weight_packed``: uint8 ``[N, K // 2]``, two E2M1 codes a byte, the low nibble holding the even
  input column and the high nibble the odd one. A code's bit 3 is its sign (code 8 is -0.0).
* ``weight_scale``: one scale per group of ``group_size`` input columns, ``[N, K // group_size]``:
  NVFP4 (group 16) stores float8_e4m3fn, MXFP4 (group 32) stores E8M0 exponent bytes (uint8).
* NVFP4 also has ``weight_global_scale`` (float32; the group scale is *divided* by it). Layers fused
  from several checkpoint tensors (qkv, gate_up) may carry a different one per shard, so this module
  takes it per output row, ``[N]``.

The decode reproduces compressed-tensors' ``decompress`` (which returns bfloat16) exactly:
``dequantize_fp4(...).to(torch.bfloat16)`` equals it bit for bit. Its float32 op order
(compressed_tensors 0.20.1):

* ``compressors/nvfp4/helpers.py::unpack_fp4_from_uint8``: ``kE2M1[code & 7] * where(code & 8, -1., 1.)``
  then ``.to(bfloat16)`` (exact: every E2M1 value is a bfloat16).
* NVFP4 ``_decompress_scale``: ``scale.to(bfloat16)`` (exact for every finite e4m3 value, NaN stays NaN).
* ``quantization/lifecycle/forward_helpers.py::_dequantize``::

      if global_scale is not None:
          scale = scale / global_scale      # bf16 [N, G, 1] / float32 [1] -> float32 division
      dequant_value = x_q.to(scale.dtype)   # -> float32
      dequant_value = dequant_value * scale # float32 product
      dequant_value.to(dtype)               # -> bfloat16 (one rounding)

  so NVFP4: ``w = code * (e4m3 / global)`` in float32, rounded once to bf16. (With a 0-dim
  ``global_scale`` torch's promotion would keep the division in bf16; checkpoints store it as ``[1]``.)
* MXFP4 ``compressors/mx_utils.py::decompress_mx_scale``: ``2.0 ** (b.int32 - 127).to(bfloat16)``,
  a bf16 power of two (b = 0 gives the subnormal 2**-127; **b = 255 gives +inf**, not NaN as the OCP
  MX spec says: we match compressed-tensors). No global scale, ``x_q(bf16) * scale(bf16)``: the
  product of a two-significant-bit code and a power of two is exact in float32 and bf16 alike
  (or overflows to inf in both), so the float32 decode rounded to bf16 is the same.
"""
from __future__ import annotations

import attrs
import torch
import torch.nn.functional as F

__all__ = [
    "E2M1",
    "FP4Weight",
    "unpack_e2m1",
    "decode_e4m3",
    "decode_e8m0",
    "nvfp4_group_scales",
    "mxfp4_group_scales",
    "group_scales",
    "dequantize_fp4",
    "fp4_linear_reference",
]


@attrs.frozen
class FP4Weight:
    """One Linear's FP4 weight as the decode GEMV takes it: ``packed`` uint8 ``[N, K/2]`` (low nibble =
    even column), ``scale`` raw scale bytes ``[N, K/group_size]`` (uint8), ``scale_kind`` ``"e4m3"``
    (NVFP4) or ``"e8m0"`` (MXFP4), ``row_global`` float32 ``[N]`` that NVFP4 rows are divided by (or None)."""

    packed: torch.Tensor
    scale: torch.Tensor
    scale_kind: str
    group_size: int
    row_global: torch.Tensor | None = None

    @property
    def shape(self) -> tuple[int, int]:
        """(N, K) of the dense weight."""
        return self.packed.shape[0], self.packed.shape[1] * 2

    @property
    def device(self) -> torch.device:
        """The device the packed weight is on."""
        return self.packed.device


# code -> value; bit 3 is the sign, so code 8 is -0.0.
E2M1 = torch.tensor(
    [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0],
    dtype=torch.float32,
)


def _build_e4m3_table() -> torch.Tensor:
    """float32 value of each of the 256 float8_e4m3fn bytes, built arithmetically.

    byte = s eeee mmm; e > 0: (-1)^s * (1 + m/8) * 2^(e-7); e == 0 (subnormal): (-1)^s * m * 2^-9;
    e == 15 and m == 7 (0x7f, 0xff): NaN. No infinities.
    """
    out = []
    for b in range(256):
        s, e, m = b >> 7, (b >> 3) & 0xF, b & 0x7
        if e == 0xF and m == 0x7:
            v = float("nan")
        elif e == 0:
            v = m * 2.0**-9
        else:
            v = (1.0 + m / 8.0) * 2.0 ** (e - 7)
        out.append(-v if s else v)
    return torch.tensor(out, dtype=torch.float32)


_E4M3_TABLE = _build_e4m3_table()


def unpack_e2m1(packed: torch.Tensor) -> torch.Tensor:
    """uint8 ``[N, K // 2]`` -> float32 ``[N, K]``; low nibble = even column, high nibble = odd."""
    if packed.dtype != torch.uint8:
        raise TypeError(f"packed FP4 weights must be uint8, got {packed.dtype}")
    codes = torch.stack((packed & 0x0F, packed >> 4), dim=-1).flatten(-2)
    return E2M1.to(packed.device)[codes.long()]


def _as_bytes(t: torch.Tensor) -> torch.Tensor:
    if t.dtype == torch.uint8:
        return t
    if t.dtype == torch.int8:
        return t.view(torch.uint8)
    if t.dtype == torch.float8_e4m3fn:
        return t.view(torch.uint8)
    raise TypeError(f"expected float8_e4m3fn or its raw uint8 bytes, got {t.dtype}")


def decode_e4m3(scale: torch.Tensor) -> torch.Tensor:
    """float8_e4m3fn (or its raw uint8 bytes) -> float32, exactly (subnormals; 0x7f/0xff -> NaN)."""
    return _E4M3_TABLE.to(scale.device)[_as_bytes(scale).long()]


def decode_e8m0(scale: torch.Tensor) -> torch.Tensor:
    """E8M0 exponent bytes -> float32 2^(b - 127), built from the float32 bit pattern (exact).

    b = 0 is the float32 subnormal 2^-127; b = 255 is +inf, as compressed-tensors'
    ``decompress_mx_scale`` gives (``2.0 ** 128`` overflows), not the OCP spec's NaN.
    """
    if scale.dtype != torch.uint8:
        raise TypeError(f"E8M0 scales must be uint8 exponent bytes, got {scale.dtype}")
    b = scale.to(torch.int32)
    bits = torch.where(b == 0, torch.full_like(b, 0x00400000), b << 23)  # b=255 -> 0x7f800000 = inf
    return bits.view(torch.float32)


def nvfp4_group_scales(weight_scale: torch.Tensor, global_scale_per_row: torch.Tensor) -> torch.Tensor:
    """``decode_e4m3(weight_scale) / global_scale`` per row: float32 ``[N, K // 16]``.

    Divided, not multiplied by a reciprocal, exactly as compressed-tensors' ``_dequantize``
    (``scale = scale / global_scale``, float32 division).
    """
    s = decode_e4m3(weight_scale)
    g = global_scale_per_row.to(device=s.device, dtype=torch.float32).reshape(-1)
    if g.numel() == 1:
        g = g.expand(s.shape[0])
    if g.numel() != s.shape[0]:
        raise ValueError(f"global scale has {g.numel()} rows, weight scale {s.shape[0]}")
    return s / g[:, None]


def mxfp4_group_scales(weight_scale: torch.Tensor) -> torch.Tensor:
    """E8M0 bytes -> float32 ``[N, K // 32]``."""
    return decode_e8m0(weight_scale)


def dequantize_fp4(packed: torch.Tensor, group_scales: torch.Tensor, group_size: int) -> torch.Tensor:
    """``code value * group scale`` in float32: ``[N, K]`` (``.to(bfloat16)`` == compressed-tensors)."""
    codes = unpack_e2m1(packed)
    n, k = codes.shape
    if k % group_size != 0:
        raise ValueError(f"K={k} is not a multiple of group_size={group_size}")
    if tuple(group_scales.shape) != (n, k // group_size):
        raise ValueError(f"group scales {tuple(group_scales.shape)} != {(n, k // group_size)}")
    w = codes.unflatten(-1, (k // group_size, group_size)) * group_scales.to(torch.float32)[..., None]
    return w.flatten(-2)


def group_scales(weight_scale: torch.Tensor, scale_kind: str, row_global_scale: torch.Tensor | None) -> torch.Tensor:
    """Float32 per-group scales of either format (``"e4m3"`` with an optional global scale, or ``"e8m0"``)."""
    if scale_kind == "e4m3":
        if row_global_scale is None:
            return decode_e4m3(weight_scale)
        return nvfp4_group_scales(weight_scale, row_global_scale)
    if scale_kind == "e8m0":
        if row_global_scale is not None:
            raise ValueError("MXFP4 (e8m0 scales) has no global scale")
        return mxfp4_group_scales(_as_bytes(weight_scale))
    raise ValueError(f"scale_kind must be 'e4m3' or 'e8m0', got {scale_kind!r}")


def fp4_linear_reference(
    x: torch.Tensor,
    packed: torch.Tensor,
    weight_scale: torch.Tensor,
    scale_kind: str,
    row_global_scale: torch.Tensor | None,
    group_size: int,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """``x @ W.T (+ bias)`` with W decoded transiently in float32; result in ``x.dtype``.

    ``x`` is ``[..., K]``; ``scale_kind`` is ``"e4m3"`` (NVFP4, with ``row_global_scale`` ``[N]``
    or a single value) or ``"e8m0"`` (MXFP4, ``row_global_scale=None``).
    """
    w = dequantize_fp4(packed, group_scales(weight_scale, scale_kind, row_global_scale), group_size)
    b = None if bias is None else bias.to(torch.float32)
    return F.linear(x.to(torch.float32), w.to(x.device), b).to(x.dtype)
