"""The ``@triton.jit`` helpers several kernels share: rounding, RMSNorm's tail, SwiGLU, loads, FP4 decode.

Each rounds as the torch op it stands for; none launches anything.

* ``INTERPRET``: whether Triton runs in the interpreter (``TRITON_INTERPRET=1``), read when this module
  is imported, which is when the kernels' ``@triton.jit`` reads it too, so the two agree. Kernels take
  it as a ``tl.constexpr``.
* :func:`cast` rounds float32 to a narrower dtype to nearest even, as CUDA's conversion does; with
  ``INTERPRET`` set it rounds bfloat16 with integer ops instead, since the interpreter's float32 ->
  bfloat16 conversion truncates (a kernel compiled with FP contraction passes True on CUDA too:
  :func:`vtcore.kernels.rope.head_epilogue`).
* :func:`normalize`: RMSNorm's elementwise tail, for :mod:`vtcore.kernels.rmsnorm` and every kernel
  that fuses a norm (the GEMV's prologue, q/k norm, the gated norm). :func:`exp` and :func:`silu_mul`:
  torch's CUDA ``expf`` and SwiGLU, for the SwiGLU kernel, the GEMV's prologue and epilogue and the
  fused MoE, so that every path rounds alike.
* :func:`load`: a tile's values, unmasked where the caller knows it is in bounds (16-byte vector loads).
* FP4 codes and scales (:mod:`vtcore.kernels.fp4` holds the format and its torch decode, which these
  equal bit for bit), decoded with integer arithmetic and a bitcast to float32:

  - E2M1 code ``s e e m`` (:func:`e2m1_to_f32`): ``e > 0``: float32 bits ``s<<31 | (e + 126)<<23 |
    m<<22`` (``(1 + m/2) * 2^(e-1)``); ``e == 0``: ``m * 0.5`` (code 8 is -0.0).
  - e4m3 scale ``s eeee mmm`` (:func:`e4m3_to_f32`): ``e > 0``: bits ``s<<31 | (e + 120)<<23 | m<<20``;
    ``e == 0``: ``±m * 2^-9`` (subnormals); ``0x7f``/``0xff``: NaN.
  - e8m0 scale ``b`` (:func:`e8m0_to_f32`): bits ``b<<23`` (``2^(b-127)``), ``b == 0``: ``0x00400000``
    (``2^-127``); ``b == 255`` gives +inf, as the reference (and compressed-tensors) does.

* :func:`fp4_step`: one K step of the decode GEMVs (:mod:`vtcore.kernels.gemv` at one row, the fused
  MoE's decode path), in the group-factored form of the product, cheap in integer work (the loop is
  bound by instruction issue, not memory): ``y = (sum_g s_g * sum_{i in g} c_i x_i) / global`` in
  float32, the scale applied once per group and the global once per row (by the caller), no weight
  rounded (more accurate than the bf16-decoded weight, equal to it up to float32 rounding). It reads
  the packed bytes as int32 words of 8 codes, x's columns ``8 w + j`` beside code ``j`` of word ``w``.
  Code decode: nibble ``j`` shifted to the top of the word and arithmetic-shifted right by 6 puts a
  code ``s e e m`` as sign copies in bits 31..25 and ``e e m`` in bits 24..22; masked to
  ``0x81C00000`` that is the float32 ``s << 31 | eem << 22``, exactly ``c * 2^-126`` (``e == 0``: the
  subnormal ``m * 2^-127``): two integer ops a code plus a shift the compiler puts on the FMA pipe.
  x is taken times 2^64 (``X_SCALE``) so each product ``(c * 2^-126) * (x * 2^64) = c * x * 2^-62`` is
  a normal float32, exact (2 and <= 24 significant bits), for any 2^-63 <= |x| < 2^64; the group
  scales are decoded times 2^62 (:func:`word_scales`), which undoes both (e8m0 scales above 2^65, far
  beyond any real weight, saturate to inf).
"""
from __future__ import annotations

import triton
import triton.language as tl
from triton.language.extra import libdevice

__all__ = ["INTERPRET", "cast", "normalize", "exp", "silu_mul", "load", "e2m1_to_f32", "e4m3_to_f32",
           "e8m0_to_f32", "X_SCALE", "word_scales", "fp4_step"]

INTERPRET: bool = bool(triton.knobs.runtime.interpret)  # read when @triton.jit is, so the two agree

#: The decode GEMVs' x scale: x times 2^64, codes as float32 ``c * 2^-126``, so each product is
#: ``c * x * 2^-62``; :func:`word_scales`' factor 2^62 undoes it.
X_SCALE: tl.constexpr = tl.constexpr(2.0 ** 64)


@triton.jit
def cast(x, DTYPE: tl.constexpr, INTERPRET: tl.constexpr):
    """float32 ``x`` -> ``DTYPE``, rounding to nearest even (the interpreter truncates to bf16)."""
    if INTERPRET and DTYPE == tl.bfloat16:
        b = x.to(tl.uint32, bitcast=True)
        b = ((b + 0x7FFF + ((b >> 16) & 1)) >> 16) << 16
        y = b.to(tl.float32, bitcast=True).to(DTYPE)
    else:
        y = x.to(DTYPE)
    return y


@triton.jit
def normalize(x, rstd, w, ZERO_CENTERED: tl.constexpr, DTYPE: tl.constexpr, INTERPRET: tl.constexpr):
    """RMSNorm's elementwise tail in float32 (``x``, ``w`` float32; ``DTYPE``: the activation dtype):
    ``(h * (1 + w))`` zero-centred, else ``h`` rounded to ``DTYPE`` times ``w``; the caller rounds."""
    h = x * rstd
    if ZERO_CENTERED:
        y = h * (1.0 + w)
    else:
        y = cast(h, DTYPE, INTERPRET).to(tl.float32) * w
    return y


@triton.jit
def exp(x, INTERPRET: tl.constexpr):
    """libdevice's ``expf`` on CUDA (what torch's CUDA kernels call; ``tl.exp`` is a bare
    ``ex2.approx``), numpy's in the interpreter."""
    if INTERPRET:
        y = tl.exp(x)
    else:
        y = libdevice.exp(x)
    return y


@triton.jit
def silu_mul(g, u, DT: tl.constexpr, INTERPRET: tl.constexpr):
    """``silu(g) * u`` of float32 ``g``, ``u`` holding ``DT`` values, rounded to ``DT`` as torch
    rounds each op: ``g / (1 + exp(-g))`` (IEEE division), rounded, times ``u``, rounded."""
    s = cast(tl.div_rn(g, 1.0 + exp(-g, INTERPRET)), DT, INTERPRET).to(tl.float32)
    return cast(s * u, DT, INTERPRET)


@triton.jit
def load(ptr, mask, EVEN: tl.constexpr):
    """``ptr``'s values, unmasked when ``EVEN`` (keeps 16-byte vector loads), else 0 where masked."""
    if EVEN:
        v = tl.load(ptr)
    else:
        v = tl.load(ptr, mask=mask, other=0.0)
    return v


@triton.jit
def e2m1_to_f32(code):
    """int32 4-bit codes -> float32 values."""
    sign = (code & 0x8) << 28
    e = (code >> 1) & 0x3
    m = code & 0x1
    normal = ((e + 126) << 23) | (m << 22)
    sub = m * 0x3F000000  # m * 0.5 as float32 bits (m is 0 or 1)
    bits = sign | tl.where(e > 0, normal, sub)
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def e4m3_to_f32(b):
    """int32 float8_e4m3fn bytes -> float32 values (subnormals, NaN at 0x7f/0xff)."""
    e = (b >> 3) & 0xF
    m = b & 0x7
    normal = (((e + 120) << 23) | (m << 20)).to(tl.float32, bitcast=True)
    sub = m.to(tl.float32) * 0.001953125  # m * 2^-9, exact
    mag = tl.where(e > 0, normal, sub)
    mag = tl.where((b & 0x7F) == 0x7F, (mag.to(tl.int32, bitcast=True) | 0x7FC00000).to(tl.float32, bitcast=True), mag)
    return tl.where((b & 0x80) != 0, -mag, mag)


@triton.jit
def e8m0_to_f32(b):
    """int32 E8M0 bytes -> float32 2^(b-127) (b=0: the subnormal 2^-127; b=255: +inf)."""
    bits = tl.where(b == 0, 0x00400000, b << 23)
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def _group_scale_f32(sb, SCALE_E8M0: tl.constexpr):
    """int32 raw scale bytes -> float32 group scales times 2^62 (the decode GEMVs' unscaling, see
    ``X_SCALE``). e4m3 through a bitcast: ``s << 31 | (b & 0x7f) << 20`` is the value times 2^-120,
    subnormals included, then times 2^91 twice; NaN at 0x7f/0xff. e8m0 ``b``: ``2^(b - 65)`` as the
    float32 bits ``(b + 62) << 23`` (b = 0, the reference's 2^-127, included), +inf from b = 193 on."""
    if SCALE_E8M0:
        s = tl.where(sb + 62 > 254, 0x7F800000, (sb + 62) << 23).to(tl.float32, bitcast=True)
    else:
        s = (((sb & 0x80) << 24) | ((sb & 0x7F) << 20)).to(tl.float32, bitcast=True)
        s = s * 2.4758800785707605e27 * 2.4758800785707605e27  # 2^91 twice: exact, and 2^182 is no float32
        s = tl.where((sb & 0x7F) == 0x7F, (s.to(tl.int32, bitcast=True) | 0x7FC00000).to(tl.float32, bitcast=True), s)
    return s


@triton.jit
def word_scales(sb, BLOCK_N: tl.constexpr, GROUPS: tl.constexpr, GROUP: tl.constexpr, SCALE_E8M0: tl.constexpr):
    """float32 ``[BLOCK_N, GROUPS * GROUP / 8]``: each group's scale times 2^62 (decoded once, from the
    int32 scale bytes ``sb`` ``[BLOCK_N, GROUPS]``) repeated for the group's words."""
    s = _group_scale_f32(sb, SCALE_E8M0)[:, :, None]
    return tl.reshape(tl.broadcast_to(s, (BLOCK_N, GROUPS, GROUP // 8)), (BLOCK_N, GROUPS * (GROUP // 8)))


@triton.jit
def fp4_step(w, sb, x_ptr, k0, k_lim, stride_xk, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP: tl.constexpr,
             SCALE_E8M0: tl.constexpr, EVEN: tl.constexpr):
    """float32 ``[BLOCK_N, BLOCK_K / 8]``: one K step (from column ``k0``) of packed words ``w``, each
    word's ``sum_j c_j x_j * 2^-62`` times its group's scale (times 2^62) (bytes ``sb`` ``[BLOCK_N, BLOCK_K / GROUP]``);
    x's column ``8 w + j`` (columns at or past ``k_lim`` read as 0) meets code ``j`` of word ``w``. No
    reduction inside the K loop: a per-group sum here cost a shared-memory layout change a step."""
    cols = 8 * tl.arange(0, BLOCK_K // 8) + k0
    for j in tl.static_range(8):
        xj = load(x_ptr + (cols + j) * stride_xk, cols < k_lim, EVEN).to(tl.float32) * X_SCALE
        # code j as float32 c * 2^-126 (the module docstring's code decode; inlined, as the
        # interpreter pays per helper call): to the top of the word, arithmetic >> 6, mask
        t = w if j == 7 else w << (28 - 4 * j)
        code = ((t >> 6) & -2118123520).to(tl.float32, bitcast=True)  # 0x81C00000 as an int32
        if j == 0:
            prod = code * xj[None, :]
        else:
            prod += code * xj[None, :]
    return prod * word_scales(sb, BLOCK_N, BLOCK_K // GROUP, GROUP, SCALE_E8M0)
