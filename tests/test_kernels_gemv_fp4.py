"""FP4 (W4A16) decode GEMV: ``vtcore.kernels.gemv`` with an ``FP4Weight``, against float64 products of
the decoded weights (``vtcore.kernels.fp4``, itself held bit-exact to compressed-tensors' decompress).

The kernel computes ``(sum_g s_g * sum_{i in g} c_i x_i) / global`` in float32; the oracle is the exact
``x @ W.T`` of the float32 decoded weights ``W = c * s / global``. float32 x: within 1e-5 of max |y|
(float32 rounding of the sums, the scale and the global division). 16-bit x: the exact product rounded
once to the dtype, 1 ulp of |y| allowed (plus 1e-3 of max |y| for values near 0), as the dense GEMV.
The weights cover every code, e4m3 subnormal and negative scales, e8m0 exponents down to 2^-127.
"""
from __future__ import annotations

import math
import re
import struct

import pytest
import torch

pytest.importorskip("triton")

from vtcore.kernels.fp4_mma import UNSCALE, _diag_asm, _pairs, _scales, _step_asm, layout_ok  # noqa: E402
from vtcore.kernels import gemv as gemv_module  # noqa: E402
from vtcore.kernels.activation import silu_and_mul  # noqa: E402
from vtcore.kernels.gemv import (  # noqa: E402
    INTERPRET, _registers, fp4_mma_tile, gemv, gemv_silu_and_mul, gemv_swiglu, narrow_layout, supports, use_fp4_mma)
from vtcore.kernels.fp4 import FP4Weight, dequantize_fp4, group_scales  # noqa: E402

interp = pytest.mark.skipif(not INTERPRET, reason="CPU tensors need the Triton interpreter")
cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

_ULP = {torch.float16: 2.0 ** -10, torch.bfloat16: 2.0 ** -7}
_GROUP = {"e4m3": 16, "e8m0": 32}


def fp4_weight(n: int, k: int, kind: str, seed: int, device: str = "cpu") -> FP4Weight:
    """Random codes (all 16 appear), scales spread over the format's range incl. subnormal e4m3 and
    negative e4m3 scales, per-row NVFP4 global scales."""
    g = torch.Generator().manual_seed(seed)
    group = _GROUP[kind]
    packed = torch.randint(0, 256, (n, k // 2), generator=g, dtype=torch.int32).to(torch.uint8)
    if kind == "e4m3":
        scale = torch.randint(0, 0x7F, (n, k // group), generator=g, dtype=torch.int32)  # no NaN byte
        scale |= torch.randint(0, 2, scale.shape, generator=g, dtype=torch.int32) << 7
        row_global = torch.rand(n, generator=g) * 400 + 1
    else:
        scale = torch.randint(100, 135, (n, k // group), generator=g, dtype=torch.int32)
        scale[0, 0] = 0  # 2^-127, the subnormal
        row_global = None
    return FP4Weight(packed.to(device), scale.to(torch.uint8).to(device), kind, group,
                     None if row_global is None else row_global.to(device))


def dense(w: FP4Weight) -> torch.Tensor:
    return dequantize_fp4(w.packed.cpu(), group_scales(w.scale.cpu(), w.scale_kind,
                                                       None if w.row_global is None else w.row_global.cpu()),
                          w.group_size)


def check(y: torch.Tensor, x: torch.Tensor, w: FP4Weight, bias: torch.Tensor | None = None) -> None:
    ref = x.double().cpu() @ dense(w).double().T + (0 if bias is None else bias.double().cpu())
    y = y.double().cpu()
    assert y.shape == ref.shape
    if x.dtype == torch.float32:
        assert (y - ref).abs().max().item() <= 1e-5 * ref.abs().max().item()
    else:
        tol = _ULP[x.dtype] * ref.abs() + 1e-3 * ref.abs().max()
        assert ((y - ref).abs() <= tol).all(), (y - ref).abs().max().item()


@interp
@pytest.mark.parametrize("kind", ["e4m3", "e8m0"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("k,split", [(256, 1), (256, 4), (512, 2), (160, 1)])  # 512/2: 4 steps a split; 160: masked tail
def test_interpreter_matches_decoded_weights(kind, dtype, k, split):
    w = fp4_weight(24, k, kind, seed=k + split)  # 24 rows: a partial N tile of 16
    x = torch.randn(1, k, generator=torch.Generator().manual_seed(1)).to(dtype)
    bias = torch.randn(24).to(dtype)
    check(gemv(x, w, bias, block_n=16, block_k=64, split_k=split), x, w, bias)


@interp
@pytest.mark.parametrize("kind,split", [("e4m3", 1), ("e8m0", 2)])
def test_interpreter_swiglu_epilogue(kind, split):
    """The SwiGLU epilogue on FP4 weights (gate rows and their up rows in one tile, each row with its
    own global scale) equals the projection followed by ``silu_and_mul``, bit for bit; 40 rows = I 20:
    the last 16-row tile holds 4 gate and 4 up rows."""
    w = fp4_weight(40, 256, kind, seed=31 + split)
    x = torch.randn(1, 256, generator=torch.Generator().manual_seed(32)).bfloat16()
    y = gemv_swiglu(x, w, block_n=16, block_k=64, split_k=split)
    assert y.shape == (1, 20)
    assert torch.equal(y, silu_and_mul(gemv(x, w, block_n=16, block_k=64, split_k=split)))


@interp
@pytest.mark.parametrize("kind,n,k,cfg", [("e4m3", 108, 512, (4, 128, 4, 3, 6)), ("e8m0", 124, 896, (4, 256, 4, 3, 6))])
def test_interpreter_tail_tiles_cut_into_k_pieces(monkeypatch, kind, n, k, cfg):
    """More tiles than SMs, not a multiple of them (3 SMs): the first 6 tiles run whole, the rest (one
    of 108 rows, partial; two of 124 rows, with a bias) have their K cut into pieces launched last
    (1 step each; 2, 2, 2 and 1 steps of 7), whose partials each tile's last piece sums. Under the
    SwiGLU epilogue the tail holds other rows (gate and up), so its sums may round differently:
    within 2 bf16 ulps of the projection then ``silu_and_mul``."""
    monkeypatch.setattr(gemv_module, "num_sms", lambda device: 3)
    assert gemv_module._config(1, n, k, 4, 3, 16, 128, None, None, None)[3:] == cfg  # split, K_SPLIT, .., full
    w = fp4_weight(n, k, kind, seed=41)
    x = torch.randn(1, k, generator=torch.Generator().manual_seed(42)).bfloat16()
    bias = torch.randn(n, generator=torch.Generator().manual_seed(43)).bfloat16() if n == 124 else None
    y = gemv(x, w, bias, block_n=16, block_k=128)
    check(y, x, w, bias)
    ref = silu_and_mul(y).float()
    assert torch.allclose(gemv_swiglu(x, w, bias, block_n=16, block_k=128).float(), ref, rtol=2 * _ULP[torch.bfloat16],
                          atol=1e-3 * ref.abs().max().item())


def test_tensor_core_layout_choice():
    """NVFP4 Qwen3-4B on 132 SMs: gate_up's whole-K launch of 32-row tiles takes the narrow layout; the
    split-K launches (down, qkv, o) the wide one (where each was measured faster, BENCHMARKS.md)."""
    for (n, k), narrow in (((19456, 2560), True), ((2560, 9728), False), ((6144, 2560), False), ((2560, 4096), False)):
        _, bn, bk, split, _, warps, _, full = gemv_module._config(1, n, k, 4, 132, None, None, None, None, None, True)
        assert fp4_mma_tile(bn, bk, warps) and full == 0
        assert narrow_layout(bn, split, warps) is narrow, (n, k)
    assert not narrow_layout(64, 1, 4) and narrow_layout(16, 1, 2)  # 8 row repetitions / 4


@interp
@pytest.mark.parametrize("magnitude", [1e-15, 1.0, 2.0 ** 40])
def test_interpreter_x_magnitudes(magnitude):
    """Codes +-0.5 (the e2m1 subnormals, decoded through float32 subnormal bits) and all the others,
    on x far from 1 both ways: the pre-scaled products must stay finite and exact (an x scale of
    2^100 turned |x| >= 2^28 into inf, and a zero code times inf into NaN)."""
    w = fp4_weight(16, 64, "e4m3", seed=3)
    x = (torch.rand(1, 64, generator=torch.Generator().manual_seed(4)) * magnitude).float()
    check(gemv(x, w, block_n=16, block_k=64), x, w)
    w.packed.copy_(torch.tensor([0x91, 0x19], dtype=torch.uint8).repeat(16, 16))  # codes 1, 9 = +0.5, -0.5
    y = gemv(x, w, block_n=16, block_k=64)
    check(y, x, w)
    assert y.abs().min() > 0


@interp
def test_interpreter_masked_tail_reads_no_scale_past_the_rows():
    """K = 160 with 64-column steps: the last step's groups 10 and 11 lie past each row; the byte after
    the last row is a NaN scale, which an unmasked load would bring in."""
    w = fp4_weight(24, 160, "e4m3", seed=12)
    buf = torch.full((25, 10), 0x7F, dtype=torch.uint8)
    buf[:24] = w.scale
    w = FP4Weight(w.packed, buf[:24], "e4m3", 16, w.row_global)
    x = torch.randn(1, 160, generator=torch.Generator().manual_seed(13))
    check(gemv(x, w, block_n=8, block_k=64), x, w)


@interp
def test_interpreter_nan_scale_gives_nan():
    w = fp4_weight(16, 64, "e4m3", seed=5)
    w.scale[3, 1] = 0x7F
    y = gemv(torch.ones(1, 64), w, block_n=16, block_k=64)
    assert torch.isnan(y[0, 3]) and not torch.isnan(y[0, torch.arange(16) != 3]).any()


def test_supports_fp4():
    w = fp4_weight(16, 64, "e4m3", seed=8)
    x = torch.randn(1, 64)
    assert supports(x, w) is INTERPRET
    assert not supports(torch.randn(2, 64), w)  # one row only
    assert not supports(x, w, fused="rms_norm") and not supports(torch.randn(1, 128), w, fused="silu_and_mul")
    assert supports(x, w, fused="swiglu") is INTERPRET  # an epilogue: FP4 takes it
    assert not supports(x, FP4Weight(w.packed, w.scale, "e4m3", 16, None))  # NVFP4 without its global
    assert not supports(x, FP4Weight(w.packed, w.scale[:, :2], "e4m3", 16, w.row_global))
    assert not supports(x, FP4Weight(w.packed, w.scale, "e4m3", 16, torch.ones(1).expand(16)))  # strided globals
    with pytest.raises(ValueError, match=r"x \(2, 64\).*FP4 weights take one row"):
        gemv(torch.randn(2, 64), w)
    if INTERPRET:
        with pytest.raises(ValueError, match="FP4 weights take no prologue"):
            gemv_silu_and_mul(torch.randn(1, 128), w)


def test_tensor_core_path_needs_compiled_nvfp4_bf16():
    """The tensor-core path (inline PTX) is CUDA-only; forcing it elsewhere names what failed."""
    w = fp4_weight(32, 256, "e4m3", seed=2)
    assert not use_fp4_mma(torch.randn(1, 256).bfloat16(), w)  # CPU: the interpreter runs no PTX
    assert layout_ok(32, 32, 4) and layout_ok(64, 32, 8) and layout_ok(16, 32, 2)
    assert not layout_ok(16, 32, 4) and not layout_ok(64, 64, 4) and not layout_ok(32, 16, 4)
    if INTERPRET:
        with pytest.raises(ValueError, match=r"fp4_mma forced but x torch.bfloat16 on cpu.*K 256"):
            gemv(torch.randn(1, 256).bfloat16(), w, fp4_mma=1)


def test_tensor_core_register_cap_keeps_the_grid_in_one_wave():
    """The register cap fits every program of the launch on the SMs at once, as high as that allows
    up to 128 (NVFP4 Qwen3-4B on the H200's 132 SMs: gate_up 608 programs, down 760, qkv 480, o 640),
    and leaves ptxas its choice where the grid would need under 64."""
    assert [_registers(p, 132, 4) for p in (608, 760, 480, 640)] == [96, 80, 128, 96]
    for programs in range(1, 132 * 8 + 1, 7):
        for warps in (2, 4, 8):
            regs = _registers(programs, 132, warps)
            per_sm = -(-programs // 132)
            if regs is None:
                assert 65536 // (per_sm * warps * 32) < 64
                continue
            assert regs % 8 == 0 and 64 <= regs <= 128 and per_sm * warps * 32 * regs <= 65536
            assert regs == 128 or per_sm * warps * 32 * (regs + 8) > 65536  # the most that fits
    with pytest.raises(TypeError, match="maxnreg"):
        gemv(torch.randn(1, 256), fp4_weight(32, 256, "e4m3", seed=2), max_regs=64)
    for bad in (-1, 300, 1.5, "96"):
        with pytest.raises(ValueError, match=rf"maxnreg={bad!r}: expected registers a thread may use, 1..255, or 0"):
            gemv(torch.randn(1, 256), fp4_weight(32, 256, "e4m3", seed=2), maxnreg=bad)


# ------------------------------------------------------------------------------------------ CUDA
#: (N, K): NVFP4 Qwen3-4B gate_up, down, fused qkv, o_proj; a Qwen3.5-35B-A3B GDN in_proj_qkvz
SHAPES = [(19456, 2560), (2560, 9728), (6144, 2560), (2560, 4096), (12288, 2048)]


@cuda
@pytest.mark.parametrize("kind", ["e4m3", "e8m0"])
@pytest.mark.parametrize("n,k", SHAPES)
def test_cuda_decode_shapes(n, k, kind):
    w = fp4_weight(n, k, kind, seed=n + k, device="cuda")
    x = torch.randn(1, k, device="cuda").bfloat16()
    check(gemv(x, w), x, w)
    check(gemv(x.float(), w), x.float(), w)


@cuda
@pytest.mark.parametrize("cfg", [{}, {"block_n": 64, "num_warps": 8}, {"block_n": 16, "num_warps": 2},
                                 {"block_n": 32, "split_k": 4}, {"block_n": 64, "split_k": 3},
                                 {"maxnreg": 0}, {"block_n": 64, "maxnreg": 64}, {"block_n": 32, "split_k": 1},
                                 {"block_n": 64, "split_k": 1}, {"block_n": 16, "num_warps": 2, "split_k": 1},
                                 {"block_n": 64, "num_warps": 8, "split_k": 1}])
def test_cuda_tensor_core_path(cfg):
    """NVFP4 with bf16 x on tensor cores (forced: it raises if the path is not taken): every code,
    subnormal and negative e4m3 scales, 23 x 256-code steps (odd: the unrolled loop's tail; split 3
    leaves a shorter last split), a partial row tile, the wide layout (split K, or whole K at 8 rows a
    thread) and the narrow one (whole K, 4 rows a thread: 32 x 4, 16 x 2, 64 x 8 rows x warps); the
    plain decode GEMV agrees."""
    w = fp4_weight(200, 23 * 256, "e4m3", seed=21, device="cuda")
    x = torch.randn(1, 23 * 256, device="cuda").bfloat16()
    y = gemv(x, w, fp4_mma=1, **cfg)
    check(y, x, w)
    plain = gemv(x, w, fp4_mma=0).double()
    assert ((y.double() - plain).abs() <= 2 * _ULP[torch.bfloat16] * plain.abs() + 1e-3 * plain.abs().max()).all()


@cuda
def test_cuda_tensor_core_codes_scales_and_nan():
    """One code a row (all 16 codes, bf16 subnormals when e == 0), at columns spread over 5 K steps
    (one split: the unrolled loop's body and its odd tail), each must land on its row times its x;
    subnormal e4m3 scales in a lane's first and second group (the two halves of its scale pair); 0x7f
    and 0xff scales, again in both halves, make their row NaN and no other."""
    n, k = 64, 1280
    x = (torch.arange(k, device="cuda") % 61 + 1).bfloat16()[None]
    rows = torch.arange(n, device="cuda")
    col = (rows * 37) % k
    col[5], col[6] = 16 * 4 + 3, 16 * 7 + 1  # groups 4 and 7
    code = (rows % 16).to(torch.uint8)
    packed = torch.zeros(n, k // 2, dtype=torch.uint8, device="cuda")
    packed[rows, col // 2] = (code << (4 * (col % 2))).to(torch.uint8)
    scale = torch.full((n, k // 16), 0x38, dtype=torch.uint8, device="cuda")  # 1.0
    scale[5, 4], scale[6, 7] = 0x01, 0x03  # e4m3 subnormals: 2^-9, 3 * 2^-9
    w = FP4Weight(packed, scale, "e4m3", 16, torch.ones(n, device="cuda"))
    y = gemv(x, w, fp4_mma=1, split_k=1)
    check(y, x, w)
    values = torch.tensor([0, .5, 1, 1.5, 2, 3, 4, 6], device="cuda")
    want = values[(code & 7).long()] * torch.where(code >= 8, -1.0, 1.0) * x[0, col].float()
    want[5] *= 2.0 ** -9
    want[6] *= 3 * 2.0 ** -9
    assert torch.equal(y[0].float(), want.bfloat16().float())
    w.scale[9, 2], w.scale[10, 3], w.scale[11, 40], w.scale[12, 79] = 0x7F, 0xFF, 0xFF, 0x7F
    y = gemv(x, w, fp4_mma=1, split_k=1)[0]
    nan = torch.zeros(n, dtype=torch.bool, device="cuda")
    nan[9:13] = True
    assert torch.equal(torch.isnan(y), nan)


@cuda
def test_cuda_tensor_core_path_needs_16_byte_alignment():
    """x, the packed words or the scales at a 4-byte offset: Triton then lays the tile out otherwise
    than the PTX assumes (all three misaligned gave wrong sums), so the float32 decode runs instead."""
    w = fp4_weight(200, 2560, "e4m3", seed=23, device="cuda")
    x = torch.randn(1, 2560, device="cuda").bfloat16()
    xs = torch.empty(1, 2562, device="cuda", dtype=torch.bfloat16)[:, 2:]
    xs.copy_(x)
    packed = torch.empty(200 * 1280 + 4, device="cuda", dtype=torch.uint8)[4:].view(200, 1280)
    packed.copy_(w.packed)
    scales = torch.empty(200 * 160 + 4, device="cuda", dtype=torch.uint8)[4:].view(200, 160)
    scales.copy_(w.scale)
    shifted = FP4Weight(packed, scales, "e4m3", 16, w.row_global)
    assert use_fp4_mma(x, w) and not use_fp4_mma(xs, w) and not use_fp4_mma(x, shifted)
    check(gemv(xs, shifted), x, w)
    with pytest.raises(ValueError, match="fp4_mma forced"):
        gemv(xs, shifted, fp4_mma=1)


@cuda
@pytest.mark.parametrize("cfg", [{}, {"fp4_mma": 0, "split_k": 1}, {"block_n": 64, "split_k": 3}])
def test_cuda_swiglu_epilogue(cfg):
    """NVFP4 Qwen3-4B gate_up with the SwiGLU epilogue (tensor cores, float32 decode, split): bit-equal
    to the projection then ``silu_and_mul``; a bf16 dense weight the same. (The float32 decode's
    default splits the last tiles' K, which are other rows under the epilogue: its sums then differ
    from the projection's in float32 rounding, so it is compared unsplit; the tail is checked in the
    interpreter and by test_cuda_decode_shapes.)"""
    x = torch.randn(1, 2560, device="cuda").bfloat16()
    for n in (19456, 2 * 1000):  # 1000 rows a half: the last tile partial
        w = fp4_weight(n, 2560, "e4m3", seed=41, device="cuda")
        assert torch.equal(gemv_swiglu(x, w, **cfg), silu_and_mul(gemv(x, w, **cfg)))
        if cfg.get("fp4_mma") == 0:  # the default (split tail tiles): the same within 2 ulps
            ref = silu_and_mul(gemv(x, w, fp4_mma=0)).float()
            assert torch.allclose(gemv_swiglu(x, w, fp4_mma=0).float(), ref, rtol=2 * _ULP[torch.bfloat16],
                                  atol=1e-3 * ref.abs().max().item())
    dense_w = torch.randn(2 * 1001, 2560, device="cuda").bfloat16() / 50
    bias = torch.randn(2 * 1001, device="cuda").bfloat16()
    assert torch.equal(gemv_swiglu(x, dense_w, bias), silu_and_mul(gemv(x, dense_w, bias)))


@cuda
def test_cuda_subnormal_codes_not_flushed():
    w = fp4_weight(256, 1024, "e4m3", seed=9, device="cuda")
    w.packed.copy_(torch.tensor([0x91, 0x19], dtype=torch.uint8, device="cuda").repeat(256, 256))
    x = torch.rand(1, 1024, device="cuda") * 1e-20
    y = gemv(x, w)
    check(y, x, w)
    assert y.abs().min() > 0


def test_linear_fp4_weight_follows_reloaded_global_scales():
    """A quantized Linear caches its per-row global scales for the GEMV; a reload of the per-shard
    globals (an in-place copy) must show up in the next call, per shard."""
    from vtcore.layers.linear import Linear
    from vtcore.quant.fp4_method import FP4Method

    class NV(FP4Method):
        format, group_size, scale_dtype, scale_kind, has_global_scale = "nv", 16, torch.float8_e4m3fn, "e4m3", True

    cfg = {"config_groups": {"g": {"targets": ["Linear"], "weights": {"num_bits": 4, "type": "float", "group_size": 16}}}}
    from vtcore.layers.quantized import take_over

    layer = Linear(32, [("q", 16), ("k", 8)])
    take_over(layer, NV(cfg))
    weights = layer.quant_weights["weight"]
    layer.weight_global_scale.data.copy_(torch.tensor([2.0, 3.0]))
    first = layer.quant.fp4_weight(weights)
    assert first.row_global.tolist() == [2.0] * 16 + [3.0] * 8
    assert layer.quant.fp4_weight(weights) is first  # cached: no gather per call
    layer.weight_global_scale.weight_loader(layer.weight_global_scale, torch.tensor([5.0]), "k")  # as the loader calls it
    assert layer.quant.fp4_weight(weights).row_global.tolist() == [2.0] * 16 + [5.0] * 8


def _bf16_bits(x: float) -> int:
    return int(torch.tensor(x, dtype=torch.float64).to(torch.bfloat16).view(torch.int16)) & 0xFFFF


def _bf16_value(bits: int) -> float:
    return float(torch.tensor(bits & 0xFFFF, dtype=torch.int32).to(torch.int16).view(torch.bfloat16))


def _run_ptx(ops: list[str], regs: dict[str, int]) -> dict[str, int]:
    """Evaluate the PTX that :func:`vtcore.kernels.fp4_mma._pairs` and ``_scales`` emit on Python ints
    (register bits; the float ops through torch's conversions, which round to nearest even as PTX's
    ``.rn`` does); an op it does not know fails the test."""
    for op in ops:
        if op in ("{", "}") or op.startswith(".reg"):
            continue
        name, args = op.rstrip(";").split(" ", 1)
        if name == "mov.b32" and args.startswith("{"):  # {lo, hi} = a
            halves, a = args.split("},")
            lo, hi = (t.strip() for t in halves.strip("{ ").split(","))
            regs[lo], regs[hi] = regs[a.strip()] & 0xFFFF, regs[a.strip()] >> 16
            continue
        dst, *src = (t.strip() for t in args.split(","))
        v = [regs[t] if t in regs else float(struct.unpack("<f", bytes.fromhex(t[2:])[::-1])[0]) if t.startswith("0f")
             else int(t, 0) for t in src]
        if name in ("mov.b32", "mov.u32", "mov.f32"):
            out = v[0]
        elif name == "setp.eq.u32":
            out = v[0] == v[1]
        elif name == "selp.f32":
            out = v[0] if v[2] else v[1]
        elif name == "add.rn.f32":
            out = _f32(v[0] + v[1])
        elif name == "shr.b32":
            out = v[0] >> v[1]
        elif name == "and.b32":
            out = v[0] & v[1]
        elif name == "mul.lo.u32":
            out = (v[0] * v[1]) & 0xFFFFFFFF
        elif name == "cvt.u16.u32":
            out = v[0] & 0xFFFF
        elif name == "cvt.rn.f16x2.e4m3x2":  # byte 0 -> low half, byte 1 -> high half
            halves = torch.tensor([v[0] & 0xFF, v[0] >> 8], dtype=torch.uint8).view(torch.float8_e4m3fn)
            bits = halves.to(torch.float16).view(torch.int16).to(torch.int32) & 0xFFFF
            out = int(bits[0]) | int(bits[1]) << 16
        elif name == "cvt.f32.f16":
            out = float(torch.tensor(v[0], dtype=torch.int32).to(torch.int16).view(torch.float16))
        elif name == "cvt.rn.bf16x2.f32":  # d.hi = a, d.lo = b
            out = _bf16_bits(regs[src[0]]) << 16 | _bf16_bits(regs[src[1]])
        elif name == "fma.rn.bf16x2":  # each half a * b + c, one rounding (exact products here)
            out = 0
            for shift in (0, 16):
                a, b, c = (_bf16_value(x >> shift) for x in v)
                out |= _bf16_bits(a * b + c) << shift
        elif name == "prmt.b32":  # default mode: selector nibble i picks byte i of {b, a} (a = bytes 0..3)
            pool = (v[0] | v[1] << 32).to_bytes(8, "little")
            out = int.from_bytes(bytes(pool[(v[2] >> 4 * i) & 7] for i in range(4)), "little")
        else:
            raise AssertionError(f"op {name} not emulated")
        regs[dst] = out
    return regs


def _f32(x: float) -> float:
    return struct.unpack("<f", struct.pack("<f", x))[0]


def _run_warp(asm: str, lanes: list[dict]) -> None:
    """Run one inline-asm body on the 32 lanes' registers in lockstep: plain ops lane by lane
    (:func:`_run_ptx`), ``mma.sync ... m16n8k16`` across the warp with PTX's fragment layouts (lane
    ``(g, tig)`` = ``(lane // 4, lane % 4)``; A's rows g, g + 8 and columns 2tig(+1), 2tig + 8(+9), B's
    column g and rows the same, C's rows g, g + 8 and columns 2tig, 2tig + 1), the products summed in
    float64 and rounded once to float32."""
    for op in asm.split("\n"):
        if not op.startswith("mma.sync"):
            for lane in lanes:
                _run_ptx([op], lane)
            continue
        d, a, b, c = ([t.strip() for t in grp.split(",")] for grp in re.findall(r"\{([^}]*)\}", op))
        amat, bmat, cmat = [[0.0] * 16 for _ in range(16)], [[0.0] * 8 for _ in range(16)], [[0.0] * 8 for _ in range(16)]
        for i, lane in enumerate(lanes):
            g, t = i // 4, i % 4
            for r, (row, col) in enumerate(((g, 2 * t), (g + 8, 2 * t), (g, 2 * t + 8), (g + 8, 2 * t + 8))):
                amat[row][col], amat[row][col + 1] = _bf16_value(lane[a[r]]), _bf16_value(lane[a[r]] >> 16)
            for r, k in enumerate((2 * t, 2 * t + 8)):
                bmat[k][g], bmat[k + 1][g] = _bf16_value(lane[b[r]]), _bf16_value(lane[b[r]] >> 16)
            for r, (row, col) in enumerate(((g, 2 * t), (g, 2 * t + 1), (g + 8, 2 * t), (g + 8, 2 * t + 1))):
                cmat[row][col] = lane[c[r]]
        for i, lane in enumerate(lanes):
            g, t = i // 4, i % 4
            for r, (row, col) in enumerate(((g, 2 * t), (g, 2 * t + 1), (g + 8, 2 * t), (g + 8, 2 * t + 1))):
                lane[d[r]] = _f32(sum(amat[row][k] * bmat[k][col] for k in range(16)) + cmat[row][col])


@pytest.mark.parametrize("narrow", [False, True])
def test_tensor_core_step_on_an_emulated_warp(narrow):
    """The whole K step and diagonal PTX of both layouts (run on the GPU only; emulated here on one
    warp of 8 rows and 256 codes, registers placed as the module docstring says Triton lays the tile
    out): every row's sum equals the float64 sum of code x scale x x. Catches a wrong operand number,
    fragment, scale or x pair in either generator."""
    g = torch.Generator().manual_seed(5 + narrow)
    words = torch.randint(0, 2 ** 32, (8, 32), generator=g, dtype=torch.int64).tolist()
    scale = torch.randint(0, 0x7F, (8, 16), generator=g) | torch.randint(0, 2, (8, 16), generator=g) << 7
    xbits = torch.randn(256, generator=g).bfloat16().view(torch.int16).to(torch.int64) & 0xFFFF
    s_val = scale.to(torch.uint8).view(torch.float8_e4m3fn).double()
    mag = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]
    ref = [sum((-1) ** (words[r][k // 8] >> (4 * (k % 8) + 3) & 1) * mag[words[r][k // 8] >> 4 * (k % 8) & 7]
               * float(s_val[r, k // 16]) * _bf16_value(int(xbits[k])) for k in range(256)) for r in range(8)]
    pair = [int(xbits[2 * p]) | int(xbits[2 * p + 1]) << 16 for p in range(128)]
    lanes, rows_of = [], []
    for i in range(32):
        if narrow:  # lane u of 16 a row: words 2 grp, 2 grp + 1; element 2q + e: row i // 16 + 2q, word e
            grp = 5 * (i % 16) % 16
            rows = [i // 16 + 2 * (e // 2) for e in range(8)]
            word = [2 * grp + e % 2 for e in range(8)]
            sc = [int(scale[r, grp]) for r in rows]
            xs = {32 + 8 * p + e: pair[4 * word[e] + p] for p in range(4) for e in range(8)}
        else:  # lane t of 8 a row: words 4t..4t+3 of rows R = i // 8 (elements 0..3) and R + 4 (4..7)
            t = i % 8
            rows = [i // 8 + 4 * (e // 4) for e in range(8)]
            word = [4 * t + e % 4 for e in range(8)]
            sc = [int(scale[r, 2 * t]) | int(scale[r, 2 * t + 1]) << 8 for r in rows]
            xs = {32 + 8 * j + e: pair[4 * (4 * t + j) + e % 4] for j in range(4) for e in range(8)}
        rows_of.append(rows)
        lanes.append({"%laneid": i, **{f"${8 + e}": 0.0 for e in range(8)},
                      **{f"${16 + e}": words[rows[e]][word[e]] for e in range(8)},
                      **{f"${24 + e}": sc[e] for e in range(8)}, **{f"${k}": v for k, v in xs.items()}})
    _run_warp(_step_asm(narrow), lanes)
    for lane in lanes:
        lane.update({f"${8 + e}": lane[f"${e}"] for e in range(8)})
    _run_warp(_diag_asm(narrow), lanes)
    got = [0.0] * 8
    for lane, rows in zip(lanes, rows_of):
        for e in range(8):
            got[rows[e]] += lane[f"${e}"] * UNSCALE.value
    top = max(abs(v) for v in ref)
    assert all(abs(a - b) <= 1e-5 * top for a, b in zip(got, ref)), (got, ref)


def test_tensor_core_scales_convert_every_e4m3_byte():
    """The tensor-core path's scale conversion (run on the GPU only; its op list checked here): the
    lane's two e4m3 bytes (bits 0..15) give ``dst0`` = (s0, s0) and ``dst1`` = (s1, s1), each s times
    2^119 exactly in bf16 (subnormal, negative and zero scales included), NaN bytes NaN."""
    consts = {reg: int(value, 0) for reg, value in re.findall(r"mov\.b32 (%c119|%z), (0x[0-9A-Fa-f]+);", _step_asm(False))}
    assert set(consts) == {"%c119", "%z"}
    for b0 in range(256):
        b1 = (b0 * 37 + 11) % 256  # every byte in both places
        out = _run_ptx(_scales("%v", "%d"), {**consts, "%v": 0xA5C30000 | b1 << 8 | b0})
        for dst, byte in (("%d0", b0), ("%d1", b1)):
            s = float(torch.tensor([byte], dtype=torch.uint8).view(torch.float8_e4m3fn).float())
            lo, hi = _bf16_value(out[dst]), _bf16_value(out[dst] >> 16)
            if math.isnan(s):
                assert math.isnan(lo) and math.isnan(hi), hex(byte)
            else:
                assert lo == hi == s * 2.0 ** 119 and math.copysign(1, lo) == math.copysign(1, s), hex(byte)


def test_tensor_core_decode_places_every_code_pair():
    """The tensor-core path's word decode (run on the GPU only; its op list checked here): pair ``n``
    of a word holds code ``n`` in its low bf16 half and code ``n + 4`` in its high one, each as the
    magnitude bits at 6..8 and the sign at bit 15 (``c * 2^-126``, see the module), for every code in
    every nibble and random neighbours."""
    g = torch.Generator().manual_seed(0)
    words = [c << (4 * j) | (int(r) & ~(0xF << (4 * j))) for j in range(8) for c in range(16)
             for r in torch.randint(0, 2 ** 31, (4,), generator=g)] + [0, 0xFFFFFFFF]
    for q in words:
        out = _run_ptx(_pairs("%q", "%d"), {"%q": q})
        for n in range(4):
            lo, hi = (q >> 4 * n) & 0xF, (q >> 4 * (n + 4)) & 0xF
            half = [(c & 7) << 6 | (c >> 3) << 15 for c in (lo, hi)]
            assert out[f"%d{n}"] == half[0] | half[1] << 16, (hex(q), n)
