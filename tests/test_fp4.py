"""FP4 (NVFP4 / MXFP4) weight decode and the Triton W4A16 GEMM.

(a)/(b): our float32 decode, rounded to bf16, equals compressed-tensors' own ``decompress`` bit for
bit (compressed-tensors is only the oracle here; vtcore never imports it). (c): the Triton kernel
(interpreter on CPU, float32) matches ``fp4_linear_reference``. (d): importing the reference pulls in
neither compressed-tensors nor triton.
"""
from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from vtcore.kernels.fp4 import (
    E2M1,
    decode_e4m3,
    decode_e8m0,
    dequantize_fp4,
    fp4_linear_reference,
    mxfp4_group_scales,
    nvfp4_group_scales,
    unpack_e2m1,
)

ALL_BYTES = torch.arange(256, dtype=torch.uint8)


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _assert_same_bits(ours: torch.Tensor, theirs: torch.Tensor) -> None:
    """Bitwise equality; NaNs must be NaN in the same places (payloads may differ)."""
    assert ours.dtype == theirs.dtype and ours.shape == theirs.shape
    nan_o, nan_t = torch.isnan(ours), torch.isnan(theirs)
    assert torch.equal(nan_o, nan_t), f"NaN positions differ at {torch.nonzero(nan_o ^ nan_t)[:5].tolist()}"
    ib = {torch.bfloat16: torch.int16, torch.float16: torch.int16, torch.float32: torch.int32}[ours.dtype]
    a, b = ours.view(ib)[~nan_o], theirs.view(ib)[~nan_t]
    bad = torch.nonzero(a != b)
    assert bad.numel() == 0, (
        f"{bad.numel()} values differ, e.g. ours {ours[~nan_o][bad[:5, 0]].tolist()} "
        f"vs {theirs[~nan_t][bad[:5, 0]].tolist()}"
    )


def _random_packed(n: int, k: int, g: torch.Generator) -> torch.Tensor:
    """Random bytes, the first 256 being every byte (so every (even, odd) code pair, -0 and +-6)."""
    p = torch.randint(0, 256, (n * k // 2,), dtype=torch.uint8, generator=g)
    p[:256] = ALL_BYTES
    return p.reshape(n, k // 2)


# ----------------------------------------------------------------------------- decode primitives


def test_e2m1_table_and_unpack_order():
    assert E2M1[8].item() == 0.0 and torch.signbit(E2M1[8])
    assert E2M1[7].item() == 6.0 and E2M1[15].item() == -6.0
    packed = torch.tensor([[0x71, 0xF8]], dtype=torch.uint8)  # low nibble first
    assert unpack_e2m1(packed).tolist() == [[0.5, 6.0, -0.0, -6.0]]
    assert torch.signbit(unpack_e2m1(packed)[0, 2])


def test_decode_e4m3_matches_torch_for_every_byte():
    ours = decode_e4m3(ALL_BYTES)
    _assert_same_bits(ours, ALL_BYTES.view(torch.float8_e4m3fn).float())
    _assert_same_bits(decode_e4m3(ALL_BYTES.view(torch.float8_e4m3fn)), ours)
    assert ours[0x7E].item() == 448.0 and ours[0xFE].item() == -448.0
    assert ours[0x01].item() == 2.0**-9 and ours[0x08].item() == 2.0**-6
    assert torch.isnan(ours[0x7F]) and torch.isnan(ours[0xFF])
    assert torch.isnan(ours).sum().item() == 2


def test_decode_e8m0_values():
    v = decode_e8m0(ALL_BYTES)
    assert v[127].item() == 1.0 and v[128].item() == 2.0 and v[126].item() == 0.5
    assert v[0].item() == 2.0**-127 and v[254].item() == 2.0**127
    assert v[255].item() == float("inf")  # compressed-tensors' behaviour (2.0 ** 128), not NaN
    ref = torch.pow(2.0, torch.arange(256, dtype=torch.float64) - 127)
    assert torch.equal(v[:255].double(), ref[:255])


# ----------------------------------------------------------------------------- (a) oracle, random bytes


@pytest.fixture(scope="module")
def ct():
    pytest.importorskip("compressed_tensors")
    from compressed_tensors.compressors.mx_utils import decompress_mx_scale
    from compressed_tensors.compressors.mxfp4.base import MXFP4PackedCompressor
    from compressed_tensors.compressors.nvfp4.base import NVFP4PackedCompressor
    from compressed_tensors.quantization import preset_name_to_scheme

    return {
        "nvfp4": (NVFP4PackedCompressor, preset_name_to_scheme("NVFP4A16", ["Linear"])),
        "mxfp4": (MXFP4PackedCompressor, preset_name_to_scheme("MXFP4A16", ["Linear"])),
        "decompress_mx_scale": decompress_mx_scale,
    }


def _ct_nvfp4(ct, packed, scale_fp8, global_scale_1):
    comp, scheme = ct["nvfp4"]
    sd = {"weight_packed": packed, "weight_scale": scale_fp8, "weight_global_scale": global_scale_1}
    return comp.decompress(sd, scheme)["weight"]


@pytest.mark.parametrize("seed", [101, 202])
def test_nvfp4_decode_matches_compressed_tensors_bitwise(ct, seed):
    g = _gen(seed)
    n, k = 64, 256  # 64 x 16 = 1024 scales
    packed = _random_packed(n, k, g)
    sbytes = torch.randint(0, 256, (n * k // 16,), dtype=torch.uint8, generator=g)
    # every e4m3 byte: zeros, subnormals (smallest 0x01), 448 (0x7e), negatives, NaN (0x7f, 0xff)
    sbytes[:256] = ALL_BYTES[torch.randperm(256, generator=g)]
    scale = sbytes.reshape(n, k // 16).view(torch.float8_e4m3fn)
    # typical (448*6/amax), unit, tiny and huge global scales; huge ones push the divided
    # scale into float32 subnormals, tiny ones towards overflow
    amax = torch.exp(torch.empty(4).uniform_(-9, 3, generator=g))
    for gs in [*(448.0 * 6.0 / amax).tolist(), 1.0, 1e-3, 3.0e-36, 1.7e38, 1.0e30]:
        gs1 = torch.tensor([gs], dtype=torch.float32)
        theirs = _ct_nvfp4(ct, packed, scale, gs1)
        assert theirs.dtype == torch.bfloat16
        ours = dequantize_fp4(packed, nvfp4_group_scales(scale, gs1.expand(n)), 16)
        assert ours.dtype == torch.float32
        _assert_same_bits(ours.to(torch.bfloat16), theirs)
        # raw uint8 scale bytes decode the same
        _assert_same_bits(dequantize_fp4(packed, nvfp4_group_scales(scale.view(torch.uint8), gs1), 16), ours)


def test_nvfp4_op_order_scale_divided_first(ct):
    """The float32 op order shows through the bf16 rounding only rarely; these global scales (found by
    search) make ``code * (s / g)`` differ in bf16 from ``code * (s * (1/g))`` and ``(code * s) / g``."""
    n = 256
    packed = torch.tensor([0x10, 0x32, 0x54, 0x76, 0x98, 0xBA, 0xDC, 0xFE], dtype=torch.uint8).repeat(n, 1)
    scale = ALL_BYTES.reshape(n, 1).view(torch.float8_e4m3fn)  # row r: every code under scale byte r
    codes, s = unpack_e2m1(packed), decode_e4m3(scale)
    alt_differs = {"reciprocal": False, "code_first": False}
    for gs in (2214.053955078125, 1482.54296875, 165.24205017089844, 0.06146572157740593):
        gs1 = torch.tensor([gs], dtype=torch.float32)
        theirs = _ct_nvfp4(ct, packed, scale, gs1)
        _assert_same_bits(dequantize_fp4(packed, nvfp4_group_scales(scale, gs1), 16).to(torch.bfloat16), theirs)
        finite = torch.isfinite(theirs)
        for name, alt in (("reciprocal", codes * (s * (1.0 / gs1))), ("code_first", (codes * s) / gs1)):
            alt_differs[name] |= bool((alt.to(torch.bfloat16).view(torch.int16) != theirs.view(torch.int16))[finite].any())
    assert alt_differs == {"reciprocal": True, "code_first": True}


def test_nvfp4_per_row_global_scale_matches_sharded_decompress(ct):
    """A fused layer (e.g. qkv) has one global scale per shard: per-row == each shard decompressed alone."""
    g = _gen(303)
    shards = [(16, 37.5), (32, 2688.0 / 0.0123), (16, 0.71)]
    k = 96
    packs, scales, rows, theirs = [], [], [], []
    for n, gs in shards:
        p = _random_packed(n, k, g)
        s = torch.randint(0, 256, (n, k // 16), dtype=torch.uint8, generator=g).view(torch.float8_e4m3fn)
        gs1 = torch.tensor([gs], dtype=torch.float32)
        theirs.append(_ct_nvfp4(ct, p, s, gs1))
        packs.append(p), scales.append(s), rows.append(gs1.expand(n))
    ours = dequantize_fp4(torch.cat(packs), nvfp4_group_scales(torch.cat(scales), torch.cat(rows)), 16)
    _assert_same_bits(ours.to(torch.bfloat16), torch.cat(theirs))


@pytest.mark.parametrize("seed", [404, 505])
def test_mxfp4_decode_matches_compressed_tensors_bitwise(ct, seed):
    g = _gen(seed)
    n, k = 32, 512  # 32 x 16 = 512 scales
    packed = _random_packed(n, k, g)
    sbytes = torch.randint(0, 256, (n * k // 32,), dtype=torch.uint8, generator=g)
    # every e8m0 byte, so 0, 1, 126, 127, 128, 254 and 255 (inf; 0 * inf = NaN) included
    sbytes[:256] = ALL_BYTES[torch.randperm(256, generator=g)]
    scale = sbytes.reshape(n, k // 32)
    comp, scheme = ct["mxfp4"]
    theirs = comp.decompress({"weight_packed": packed, "weight_scale": scale}, scheme)["weight"]
    assert theirs.dtype == torch.bfloat16
    ours = dequantize_fp4(packed, mxfp4_group_scales(scale), 32)
    _assert_same_bits(ours.to(torch.bfloat16), theirs)


def test_e8m0_scale_matches_compressed_tensors_every_byte(ct):
    theirs = ct["decompress_mx_scale"](ALL_BYTES)
    _assert_same_bits(decode_e8m0(ALL_BYTES).to(torch.bfloat16), theirs)
    assert theirs[255].item() == float("inf") and decode_e8m0(ALL_BYTES)[255].item() == float("inf")
    assert theirs[0].item() == 2.0**-127


# ----------------------------------------------------------------------------- (b) compress round trip


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
def test_compress_then_our_decode_equals_decompress(ct, fmt):
    from compressed_tensors.quantization.utils import calculate_qparams, generate_gparam

    g = _gen(606 if fmt == "nvfp4" else 707)
    comp, scheme = ct[fmt]
    gsz = scheme.weights.group_size
    n, k = 40, 8 * gsz
    w = torch.randn(n, k, generator=g) * torch.exp(torch.empty(n, 1).uniform_(-6, 1, generator=g))
    w[0, :gsz] = 0.0
    w[1, :gsz] = -0.0
    w[2, :gsz] = torch.linspace(-1, 1, gsz)  # group max hits +-6 exactly
    w[3, gsz : 2 * gsz] = 1e-6 * torch.randn(gsz, generator=g)  # tiny group: subnormal-ish scales
    groups = w.unflatten(-1, (k // gsz, gsz))
    sd = {"weight": w}
    gs = None
    if fmt == "nvfp4":
        gs = generate_gparam(w.min(), w.max())
        sd["weight_global_scale"] = gs
    sd["weight_scale"], _ = calculate_qparams(groups.amin(-1), groups.amax(-1), scheme.weights, global_scale=gs)
    c = comp.compress(sd, scheme)
    theirs = comp.decompress(dict(c), scheme)["weight"]
    if fmt == "nvfp4":
        assert c["weight_scale"].dtype == torch.float8_e4m3fn
        ours = dequantize_fp4(c["weight_packed"], nvfp4_group_scales(c["weight_scale"], c["weight_global_scale"]), 16)
    else:
        assert c["weight_scale"].dtype == torch.uint8
        ours = dequantize_fp4(c["weight_packed"], mxfp4_group_scales(c["weight_scale"]), 32)
    _assert_same_bits(ours.to(torch.bfloat16), theirs)
    # and it is a quantization of w: within about half the largest step (2 * scale) of each group
    # whose scale is not limited by the scale format's range
    gmax = groups.abs().amax(-1, keepdim=True)
    err = (ours.unflatten(-1, (k // gsz, gsz)) - groups).abs()
    ok = err <= gmax / 6.0 * (2.0 if fmt == "mxfp4" else 1.2)
    assert ok[(gmax > 1e-3 * w.abs().max()).expand_as(ok)].all()


# ----------------------------------------------------------------------------- (c) Triton kernel


def _case(kind: str, m: int, n: int, k: int, bias: bool, seed: int, global_mode: str = "row"):
    g = _gen(seed)
    gsz = 16 if kind == "e4m3" else 32
    packed = _random_packed(n, k, g) if n * k >= 512 else torch.randint(0, 256, (n, k // 2), dtype=torch.uint8, generator=g)
    if kind == "e4m3":
        # finite e4m3 bytes (0x00-0x7e, 0x80-0xfe): zeros, subnormals and 448 included
        sb = torch.randint(0, 0x7F, (n, k // gsz), dtype=torch.uint8, generator=g)
        sb |= (torch.randint(0, 2, sb.shape, generator=g) << 7).to(torch.uint8)
        gl = {"row": torch.empty(n).uniform_(20.0, 2000.0, generator=g), "one": torch.tensor([448.0 * 6 / 0.37]), "none": None}[global_mode]
    else:
        sb = torch.randint(110, 140, (n, k // gsz), dtype=torch.uint8, generator=g)
        gl = None
    x = torch.randn(m, k, generator=g)
    b = torch.randn(n, generator=g) if bias else None
    return x, packed, sb, gl, gsz, b


def _check_close(y, ref, x, packed, sb, kind, gl, gsz, rtol=1e-5):
    """|y - ref| <= rtol * (|x| @ |W|.T): a bound that ignores cancellation in the sums."""
    assert y.shape == ref.shape and y.dtype == ref.dtype
    w = dequantize_fp4(packed, nvfp4_group_scales(sb, gl) if (kind == "e4m3" and gl is not None)
                       else (decode_e4m3(sb) if kind == "e4m3" else decode_e8m0(sb)), gsz)
    bound = rtol * (x.abs().reshape(-1, x.shape[-1]) @ w.abs().T).reshape(ref.shape) + 1e-30
    err = (y - ref).abs()
    assert (err <= bound).all(), f"max err {err.max().item()} (bound there {bound.flatten()[err.argmax()].item()})"


@pytest.fixture(scope="module")
def fp4_matmul():
    pytest.importorskip("triton")
    from vtcore.kernels.fp4_gemm import fp4_matmul

    return fp4_matmul


@pytest.mark.parametrize("m", [1, 3, 17, 64, 100])
@pytest.mark.parametrize("kind", ["e4m3", "e8m0"])
@pytest.mark.parametrize("bias", [False, True])
def test_kernel_matches_reference(fp4_matmul, m, kind, bias):
    # N odd (not a multiple of BLOCK_N), K an odd number of groups and more than one BLOCK_K (tail masked)
    n, k = (75, 16 * 11) if kind == "e4m3" else (67, 32 * 7)
    x, packed, sb, gl, gsz, b = _case(kind, m, n, k, bias, seed=1000 + 10 * m + bias + (kind == "e8m0"))
    y = fp4_matmul(x, packed, sb, kind, gl, gsz, b)
    ref = fp4_linear_reference(x, packed, sb, kind, gl, gsz, b)
    _check_close(y, ref, x, packed, sb, kind, gl, gsz)


@pytest.mark.parametrize("global_mode", ["one", "none"])
def test_kernel_global_scale_variants_and_small_blocks(fp4_matmul, global_mode):
    # per-tensor (one value) / no global scale; small blocks: several programs in M and N, short K steps
    x, packed, sb, gl, gsz, b = _case("e4m3", 20, 45, 16 * 5, True, seed=77, global_mode=global_mode)
    ref = fp4_linear_reference(x, packed, sb, "e4m3", gl, gsz, b)
    y = fp4_matmul(x, packed, sb.view(torch.float8_e4m3fn), "e4m3", gl, gsz, b, block_m=16, block_n=32, block_k=32)
    _check_close(y, ref, x, packed, sb, "e4m3", gl, gsz)


def test_kernel_batched_noncontiguous_input(fp4_matmul):
    x, packed, sb, gl, gsz, b = _case("e8m0", 2 * 5, 33, 32 * 3, False, seed=88)
    x3 = x.reshape(2, 5, -1).transpose(0, 1)  # [5, 2, K], non-contiguous
    y = fp4_matmul(x3, packed, sb, "e8m0", None, gsz)
    assert y.shape == (5, 2, 33)
    ref = fp4_linear_reference(x3, packed, sb, "e8m0", None, gsz)
    _check_close(y, ref, x3, packed, sb, "e8m0", None, gsz)


@pytest.mark.parametrize("kind", ["e4m3", "e8m0"])
def test_kernel_decodes_every_scale_byte_exactly(fp4_matmul, kind):
    """x = I: y = W.T, so the kernel's in-register decode equals the reference's bit for bit."""
    gsz = 16 if kind == "e4m3" else 32
    g = _gen(99 if kind == "e4m3" else 98)
    n, k = 64, 4 * gsz
    sb = torch.randint(0, 256, (n * k // gsz,), dtype=torch.uint8, generator=g)
    if kind == "e4m3":
        sb[:256] = ALL_BYTES
        sb[(sb & 0x7F) == 0x7F] = 0x7E  # NaN scales are covered below; here every output must be finite
        gl = torch.empty(n).uniform_(0.01, 3000.0, generator=g)
    else:
        sb[:253] = ALL_BYTES[:253]
        sb[sb > 252] = 252  # 2^126 * 6 still fits in float32; 253+ would make inf * 0 = NaN
        gl = None
    sb = sb.reshape(n, k // gsz)
    packed = _random_packed(n, k, g)
    x = torch.eye(k)
    y = fp4_matmul(x, packed, sb, kind, gl, gsz, block_m=64, block_n=64, block_k=128)
    w = dequantize_fp4(packed, nvfp4_group_scales(sb, gl) if kind == "e4m3" else mxfp4_group_scales(sb), gsz)
    assert torch.isfinite(w).all()
    assert torch.equal(y, w.T)  # == (so -0 matches 0: the sum adds +0 terms)


@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")
def test_kernel_propagates_nan_and_inf_scales_like_reference(fp4_matmul):
    x = torch.randn(2, 64, generator=_gen(5))
    packed = torch.full((3, 32), 0x22, dtype=torch.uint8)  # all codes 2 (1.0)
    e4 = torch.full((3, 4), 0x38, dtype=torch.uint8)  # 1.0
    e4[1, 2] = 0x7F  # NaN
    e4[2, 0] = 0xFF  # -NaN
    y = fp4_matmul(x, packed, e4, "e4m3", torch.tensor([2.0]), 16)
    ref = fp4_linear_reference(x, packed, e4, "e4m3", torch.tensor([2.0]), 16)
    assert torch.equal(torch.isnan(y), torch.isnan(ref)) and torch.isnan(y[:, 1:]).all()
    torch.testing.assert_close(y[:, 0], ref[:, 0], rtol=1e-5, atol=1e-5)
    e8 = torch.full((3, 2), 127, dtype=torch.uint8)
    e8[1, 1] = 255  # inf scale -> +-inf weights
    x = x.abs()  # same-signed terms: the inf weights give +inf, not inf - inf
    y = fp4_matmul(x, packed, e8, "e8m0", None, 32)
    ref = fp4_linear_reference(x, packed, e8, "e8m0", None, 32)
    assert torch.isinf(ref[:, 1]).all()
    assert torch.equal(y[:, 1], ref[:, 1])


# ----------------------------------------------------------------------------- (d) import hygiene


def test_reference_imports_neither_compressed_tensors_nor_triton():
    code = (
        "import sys, vtcore.kernels.fp4\n"
        "bad = sorted(m for m in sys.modules if m.split('.')[0] in ('compressed_tensors', 'triton'))\n"
        "assert not bad, bad\n"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
