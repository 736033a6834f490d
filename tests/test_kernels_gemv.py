"""Skinny GEMM (``vtcore.kernels.gemv``) against float32/float64 references.

Tolerances, and why:

* float32: within 1e-5 relative (of the max |y|) of the float64 product: only the float32
  summation order differs (the fp32 tl.dot runs with ``input_precision="ieee"``).
* float16 / bfloat16: the reference is the exact (float64) ``x @ w.T + b`` rounded once to the
  dtype; the kernel rounds its float32 accumulation once, which differs from the exact sum far below
  a 16-bit ulp (and ``(x.float() @ w.float().T).to(dtype)`` is the same up to that; float64 keeps the
  oracle independent of any TF32 setting on CUDA). The two may straddle a rounding boundary, so 1
  ulp of the dtype (relative to |y|, plus 1e-3 of max |y| absolute for values that cancel near 0) is
  allowed. ``F.linear`` itself on bf16 CPU may differ from such a reference by 1 ulp, so it is not
  the oracle.
* The interpreter runs only fp32/fp16 through the ``tl.dot`` path (M > 1): its dot mishandles
  bf16 bits. bf16 runs there on the elementwise M == 1 path only, and everywhere in the CUDA section.
* Split-K vs no split: the same products summed in another order, so equal within the tolerance
  above (not bit-equal); a split config is deterministic (same bits on a second call).

On CPU the kernels run in the Triton interpreter on tiny shapes with small forced blocks (several
N tiles, several K tiles, split and unsplit); the CUDA section runs the Qwen3-0.6B / 4B decode shapes
in bf16 with the heuristic's configs, and inside a CUDA graph.
"""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from vtcore.kernels.activation import silu_and_mul  # noqa: E402
from vtcore.kernels.gemv import (  # noqa: E402
    INTERPRET, _config, gemv, gemv_ref, gemv_rms_norm, gemv_silu_and_mul, gemv_swiglu, supports)
from vtcore.kernels.rmsnorm import fused_add_rms_norm, rms_norm  # noqa: E402
from vtcore.kernels.workspace import arrival_counters  # noqa: E402

interp = pytest.mark.skipif(not INTERPRET, reason="CPU tensors need the Triton interpreter")
cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

_ULP = {torch.float16: 2.0 ** -10, torch.bfloat16: 2.0 ** -7}


def _operands(m: int, n: int, k: int, dtype: torch.dtype, seed: int, device: str = "cpu", bias: bool = False,
              x_stride: int | None = None):
    g = torch.Generator().manual_seed(seed)
    w = (torch.randn((n, k), generator=g) / k ** 0.5).to(dtype=dtype, device=device)
    if x_stride is None:
        x = torch.randn((m, k), generator=g).to(dtype=dtype, device=device)
    else:  # rows `x_stride` apart inside a wider buffer (e.g. a slice of a fused activation)
        x = torch.randn((m, x_stride), generator=g).to(dtype=dtype, device=device)[:, 3 * 8:3 * 8 + k]
        assert x.stride(0) == x_stride
    b = torch.randn((n,), generator=g).to(dtype=dtype, device=device) if bias else None
    return x, w, b


def _check(y: torch.Tensor, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> None:
    assert y.shape == (x.shape[0], w.shape[0]) and y.dtype == x.dtype and y.is_contiguous()
    if x.dtype == torch.float32:
        ref = x.double() @ w.double().T + (0 if b is None else b.double())
        err = (y.double() - ref).abs().max().item()
        assert err <= 1e-5 * ref.abs().max().item(), err
        return
    exact = (x.double() @ w.double().T + (0 if b is None else b.double())).float()
    ref = exact.to(x.dtype).float()
    tol = _ULP[x.dtype] * exact.abs() + 1e-3 * exact.abs().max()
    bad = (y.float() - ref).abs() > tol
    assert not bad.any(), ((y.float() - ref).abs().max().item(), bad.sum().item())


# ------------------------------------------------------------------------------------ interpreter
# Small forced blocks: (block_n, block_k) for M == 1 and for M > 1 (the dot needs >= 16).
_BLOCKS = {1: (8, 32), 3: (16, 32), 16: (16, 32)}


@interp
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("k", [192, 72])  # 6 K tiles of 32; 72: 3 tiles, the last one masked
@pytest.mark.parametrize("n", [24, 64])  # 24: a partial N tile
@pytest.mark.parametrize("m", [1, 3, 16])
def test_interpreter(m, n, k, dtype):
    bn, bk = _BLOCKS[m]
    x, w, b = _operands(m, n, k, dtype, seed=m * 1000 + n * 10 + k, bias=True)
    assert supports(x, w, b)
    y1 = gemv(x, w, block_n=bn, block_k=bk, split_k=1)
    _check(y1, x, w, None)
    y2 = gemv(x, w, b, block_n=bn, block_k=bk, split_k=2)  # split-K + bias through the reduce kernel
    _check(y2, x, w, b)
    y3 = gemv(x, w, b, block_n=bn, block_k=bk, split_k=1)
    _check(y3, x, w, b)
    # Split vs no split: same products, other summation order.
    torch.testing.assert_close(y2, y3, rtol=0 if dtype == torch.float32 else _ULP[dtype],
                               atol=1e-5 if dtype == torch.float32 else 1e-3)
    if k == 192:  # split 3 (two K tiles each), and the default config
        _check(gemv(x, w, b, block_n=bn, block_k=bk, split_k=3), x, w, b)
        _check(gemv(x, w, b), x, w, b)


@interp
@pytest.mark.parametrize("m", [1, 4])
def test_interpreter_strided_rows(m):
    x, w, b = _operands(m, 40, 96, torch.float32, seed=7, bias=True, x_stride=200)
    bn, bk = _BLOCKS[min(m, 3)]
    _check(gemv(x, w, b, block_n=bn, block_k=bk, split_k=1), x, w, b)
    _check(gemv(x, w, b, block_n=bn, block_k=bk, split_k=2), x, w, b)
    _check(gemv(x, w, b, block_n=bn, block_k=bk, split_k=2), x.contiguous(), w, b)


@interp
def test_interpreter_bf16_elementwise():
    """bf16 on the M == 1 path (no tl.dot): exact products, float32 sum, rounding to nearest even."""
    x, w, b = _operands(1, 64, 192, torch.bfloat16, seed=3, bias=True)
    for split in (1, 3):
        _check(gemv(x, w, b, block_n=8, block_k=64, split_k=split), x, w, b)


def _grid_operands(m: int, n: int, k: int, dtype: torch.dtype, seed: int, device: str = "cpu"):
    """Values j / 8, |j| <= 16: every product is a multiple of 1/64 below 4 in magnitude, so any
    float32 sum over K <= 2^16 of them is exact and the result must be the exact value rounded
    once, to nearest even: bit-equal, whatever the summation order or split."""
    g = torch.Generator().manual_seed(seed)

    def grid(*shape):
        return (torch.randint(-16, 17, shape, generator=g) / 8).to(dtype=dtype, device=device)
    return grid(m, k), grid(n, k), grid(n)


def _check_exact(y: torch.Tensor, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor) -> None:
    exact = (x.double() @ w.double().T + b.double()).float()  # exact in float32 (see _grid_operands)
    assert torch.equal(y, exact.to(x.dtype)), (y.float() - exact).abs().max().item()


@interp
@pytest.mark.parametrize("m,dtype", [(1, torch.bfloat16), (1, torch.float16), (3, torch.float16)])
def test_interpreter_exact_rounding(m, dtype):
    x, w, b = _grid_operands(m, 40, 192, dtype, seed=m)
    bn, bk = _BLOCKS[m]
    for split in (1, 2):
        _check_exact(gemv(x, w, b, block_n=bn, block_k=bk, split_k=split), x, w, b)


@interp
def test_interpreter_deterministic_and_ref():
    x, w, b = _operands(3, 24, 192, torch.float16, seed=5, bias=True)
    y = gemv(x, w, b, block_n=16, block_k=32, split_k=3)
    assert torch.equal(y, gemv(x, w, b, block_n=16, block_k=32, split_k=3))
    torch.testing.assert_close(y, gemv_ref(x.float(), w.float(), b.float()).to(y.dtype), rtol=1e-3, atol=1e-3)
    assert gemv(x[:0], w).shape == (0, 24)


def test_supports():
    x, w, b = _operands(2, 16, 64, torch.float16, seed=0, bias=True)
    assert supports(x, w, b) == INTERPRET
    if not INTERPRET:
        return
    assert not supports(torch.zeros(17, 64, dtype=torch.float16), w)  # M > 16
    assert not supports(x.float(), w)  # dtypes differ
    assert not supports(x.to(torch.float64), w.to(torch.float64))
    assert not supports(torch.zeros(2, 60, dtype=torch.float16), torch.zeros(16, 60, dtype=torch.float16))  # K % 8
    assert not supports(x, w.T.contiguous().T)  # weight not contiguous
    assert not supports(x.T.contiguous().T, w)  # x's last dim strided
    assert not supports(x, w, b.float())
    assert not supports(x, w[:, :32])  # K mismatch (and not contiguous)


def test_config_heuristic():
    """Qwen3 decode shapes on 132 SMs: at least a program per SM, 4-8 KB weight tiles, split only when
    the N tiles alone are fewer than the SMs."""
    for m in (1, 16):
        for k, n in ((1024, 4096), (2048, 1024), (1024, 6144), (3072, 1024),
                     (2560, 6144), (4096, 2560), (2560, 19456), (9728, 2560)):
            block_m, bn, bk, split, k_split, _, _, _ = _config(m, n, k, 16, 132, None, None, None, None, None)
            assert (block_m == 1) == (m == 1) and k_split % bk == 0 and (split - 1) * k_split < k <= split * k_split
            assert triton_cdiv(n, bn) * split >= 132, (m, n, k)
            assert 4096 <= bn * bk * 2 <= 8192
            if triton_cdiv(n, bn) >= 132:
                assert split == 1


def triton_cdiv(a: int, b: int) -> int:
    return -(-a // b)


# ------------------------------------------------------------------------------------------ CUDA

SHAPES = [  # (K, N): Qwen3-0.6B qkv, o, gate_up, down; Qwen3-4B the same four
    (1024, 4096), (2048, 1024), (1024, 6144), (3072, 1024),
    (2560, 6144), (4096, 2560), (2560, 19456), (9728, 2560),
]


@cuda
@pytest.mark.parametrize("m", [1, 2, 7, 16])
@pytest.mark.parametrize("k,n", SHAPES)
def test_cuda_bf16(k, n, m):
    x, w, b = _operands(m, n, k, torch.bfloat16, seed=k + n + m, device="cuda", bias=True)
    assert supports(x, w, b)
    _check(gemv(x, w), x, w, None)
    y = gemv(x, w, b)
    _check(y, x, w, b)
    assert torch.equal(y, gemv(x, w, b))  # deterministic
    xs, _, _ = _operands(m, n, k, torch.bfloat16, seed=1, device="cuda", x_stride=k + 64)
    _check(gemv(xs, w, b), xs, w, b)


@cuda
@pytest.mark.parametrize("m", [1, 4])
@pytest.mark.parametrize("k,n", [(1024, 4096), (3072, 1024)])  # unsplit, split
def test_cuda_exact_rounding(k, n, m):
    x, w, b = _grid_operands(m, n, k, torch.bfloat16, seed=k + m, device="cuda")
    _check_exact(gemv(x, w, b), x, w, b)


@cuda
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_cuda_other_dtypes(dtype):
    for m in (1, 5):
        x, w, b = _operands(m, 1024, 3072, dtype, seed=m, device="cuda", bias=True)
        _check(gemv(x, w, b), x, w, b)


@cuda
def test_cuda_graph_replay():
    """Unsplit (qkv) and split-K (down_proj) launches captured in one graph, replayed on new inputs."""
    dev = "cuda"
    x1, w1, b1 = _operands(1, 4096, 1024, torch.bfloat16, seed=1, device=dev, bias=True)
    x2, w2, _ = _operands(4, 1024, 3072, torch.bfloat16, seed=2, device=dev)
    assert _config(4, 1024, 3072, 2, 132, None, None, None, None, None)[3] > 1  # the split path

    def step() -> tuple[torch.Tensor, ...]:
        return gemv(x1, w1, b1), gemv(x2, w2), gemv(x2[:1], w2, split_k=3)

    step()  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = step()
    x1.copy_(_operands(1, 4096, 1024, torch.bfloat16, seed=11, device=dev)[0])
    x2.copy_(_operands(4, 1024, 3072, torch.bfloat16, seed=12, device=dev)[0])
    graph.replay()
    torch.cuda.synchronize()
    _check(outs[0], x1, w1, b1)
    _check(outs[1], x2, w2, None)
    _check(outs[2], x2[:1], w2, None)


@cuda
def test_cuda_split_arrivals_stress():
    """The last-arriving split reduces: 300 graph replays of split launches (M = 1 and 16, with and
    without prologues) give the same bits every time, equal to the eager result; a reduce that read
    a partial before it landed, or a counter left non-zero, would show as a differing replay."""
    dev = "cuda"
    x, w, b = _operands(1, 1024, 3072, torch.bfloat16, seed=21, device=dev, bias=True)
    x16 = _operands(16, 1024, 3072, torch.bfloat16, seed=22, device=dev)[0]
    gate_up = _operands(1, 1024, 6144, torch.bfloat16, seed=23, device=dev)[0]
    r = _operands(16, 1024, 3072, torch.bfloat16, seed=24, device=dev)[0]
    norm_w = torch.ones(3072, dtype=torch.bfloat16, device=dev)

    def step() -> tuple[torch.Tensor, ...]:
        return (gemv(x, w, b), gemv(x16, w), gemv_silu_and_mul(gate_up, w),
                *gemv_rms_norm(x16, r, norm_w, 1e-6, w))

    eager = step()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = step()
    for _ in range(300):
        graph.replay()
        torch.cuda.synchronize()
        for o, e in zip(outs, eager):
            assert torch.equal(o, e)
    _check(outs[0], x, w, b)
    assert not arrival_counters(x.device, 1024).any()


@cuda
@pytest.mark.parametrize("m", [1, 5])
def test_cuda_prologues_equal_their_kernels(m):
    dev = "cuda"
    for k, n in ((1024, 4096), (3072, 1024)):  # unsplit and split
        x, w, b = _operands(m, n, k, torch.bfloat16, seed=k + m, device=dev, bias=True)
        gate_up = _operands(m, n, 2 * k, torch.bfloat16, seed=k + m + 1, device=dev)[0] * 3
        assert torch.equal(gemv_silu_and_mul(gate_up, w, b), gemv(silu_and_mul(gate_up), w, b))
        r = _operands(m, n, k, torch.bfloat16, seed=k + m + 2, device=dev)[0]
        norm_w = (torch.rand(k, device=dev) + 0.5).to(torch.bfloat16)
        y, new_r = gemv_rms_norm(x, r, norm_w, 1e-6, w, b)
        normed, expect_r = fused_add_rms_norm(x, r, norm_w, 1e-6)
        assert torch.equal(new_r, expect_r)
        # the sum of squares is ordered differently: the normed input may differ by an ulp
        torch.testing.assert_close(y, gemv(normed, w, b), rtol=2e-2, atol=2e-2)


@interp
def test_bad_operands_are_named():
    with pytest.raises(ValueError, match=r"weight \(8, 16\)"):
        gemv(torch.randn(2, 24), torch.randn(8, 16))
    with pytest.raises(ValueError, match=r"gate_up \[M<=16, 32\]"):
        gemv_silu_and_mul(torch.randn(2, 24), torch.randn(8, 16))
    with pytest.raises(ValueError, match=r"norm_weight \(8,\)"):
        gemv_rms_norm(torch.randn(2, 16), None, torch.randn(8), 1e-6, torch.randn(8, 16))
    with pytest.raises(TypeError, match="block_m"):
        gemv(torch.randn(2, 16), torch.randn(8, 16), block_m=16)


# ------------------------------------------------------------------------------------ prologues
# The fused prologue must equal its standalone kernel followed by the plain GEMV of the same
# config bit for bit: same rounded inputs, same products, same summation order. Grid values keep
# the norm's sum of squares exact (its order differs between the two kernels).


def _counters_zero(n: int) -> bool:
    return not arrival_counters(torch.device("cpu"), n)[:n].any()


@interp
@pytest.mark.parametrize("m,dtype", [(1, torch.bfloat16), (1, torch.float32), (3, torch.float16)])
@pytest.mark.parametrize("split", [1, 3])
def test_interpreter_silu_and_mul_prologue(m, dtype, split):
    bn, bk = _BLOCKS[m]
    g = torch.Generator().manual_seed(11 * m + split)
    gate_up = (torch.randn((m, 2 * 192), generator=g) * 2).to(dtype)
    w = (torch.randn((40, 192), generator=g) / 192 ** 0.5).to(dtype)
    b = torch.randn((40,), generator=g).to(dtype)
    assert supports(gate_up, w, b, fused="silu_and_mul") and not supports(gate_up, w, b)
    y = gemv_silu_and_mul(gate_up, w, b, block_n=bn, block_k=bk, split_k=split)
    assert torch.equal(y, gemv(silu_and_mul(gate_up), w, b, block_n=bn, block_k=bk, split_k=split))
    assert _counters_zero(8)
    gate, up = gate_up.double().chunk(2, dim=-1)  # and near the float64 truth (silu's rounding aside)
    torch.testing.assert_close(y.double(), (torch.nn.functional.silu(gate) * up) @ w.double().T + b.double(),
                               rtol=2e-2, atol=2e-2)


@interp
@pytest.mark.parametrize("m,dtype", [(1, torch.bfloat16), (1, torch.float32), (3, torch.float16)])
@pytest.mark.parametrize("split", [1, 2])
@pytest.mark.parametrize("zero_centered", [False, True])
@pytest.mark.parametrize("with_residual", [True, False])
def test_interpreter_rms_norm_prologue(m, dtype, split, zero_centered, with_residual):
    bn, bk = _BLOCKS[m]
    x, w, b = _grid_operands(m, 40, 192, dtype, seed=m + 2 * split)
    g = torch.Generator().manual_seed(5)
    residual = (torch.randint(-16, 17, (m, 192), generator=g) / 8).to(dtype) if with_residual else None
    norm_w = (torch.randn(192, generator=g) * 0.5 + (0 if zero_centered else 1)).to(dtype)
    y, new_residual = gemv_rms_norm(x, residual, norm_w, 1e-6, w, b, zero_centered, block_n=bn, block_k=bk,
                                    split_k=split)
    if with_residual:
        normed, expect_residual = fused_add_rms_norm(x, residual, norm_w, 1e-6, zero_centered)
        assert torch.equal(new_residual, expect_residual)
    else:
        normed = rms_norm(x, norm_w, 1e-6, zero_centered)
        assert new_residual is None
    assert torch.equal(y, gemv(normed, w, b, block_n=bn, block_k=bk, split_k=split))
    assert _counters_zero(8)


@interp
def test_interpreter_rms_norm_prologue_many_programs_write_the_residual():
    """The new residual is written by the split-0 programs, K tiles shared out over the n tiles:
    more K tiles than n tiles (and the reverse) must each cover every column exactly."""
    for n, k, bk in ((16, 256, 32), (64, 64, 32)):
        x, w, b = _grid_operands(1, n, k, torch.float32, seed=n)
        r = _grid_operands(1, n, k, torch.float32, seed=n + 1)[0]
        norm_w = torch.ones(k)
        y, new_r = gemv_rms_norm(x, r, norm_w, 1e-6, w, None, block_n=8, block_k=bk, split_k=2)
        assert torch.equal(new_r, x + r)
        assert torch.equal(y, gemv(fused_add_rms_norm(x, r, norm_w, 1e-6)[0], w, block_n=8, block_k=bk, split_k=2))


@interp
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("split", [1, 3])
@pytest.mark.parametrize("i", [32, 30])  # 30: the last tile's gate and up halves partial (4 rows each a tile)
def test_interpreter_swiglu_epilogue(dtype, split, i):
    """``gemv_swiglu`` equals ``silu_and_mul(gemv(...))`` bit for bit: a tile holds gate rows and the
    matching up rows (not rows ``I`` apart in one half), the sums round as the projection's output."""
    g = torch.Generator().manual_seed(i + split)
    x = torch.randn((1, 192), generator=g).to(dtype)
    w = (torch.randn((2 * i, 192), generator=g) / 192 ** 0.5 * 3).to(dtype)
    b = torch.randn((2 * i,), generator=g).to(dtype)
    assert supports(x, w, b, fused="swiglu") and not supports(torch.randn(2, 192).to(dtype), w, b, fused="swiglu")
    for bias in (None, b):
        y = gemv_swiglu(x, w, bias, block_n=8, block_k=32, split_k=split)
        assert y.shape == (1, i) and y.dtype == dtype
        assert torch.equal(y, silu_and_mul(gemv(x, w, bias, block_n=8, block_k=32, split_k=split)))
    assert _counters_zero(8)
    with pytest.raises(ValueError, match=r"gemv_swiglu: x \(1, 192\), weight \(7, 192\).*even number"):
        gemv_swiglu(x, w[:7])


@interp
def test_interpreter_split_counters_reset():
    """Split-K arrivals leave every counter at zero, so the next launch's last arrival is right."""
    x, w, b = _operands(1, 64, 192, torch.float32, seed=9, bias=True)
    first = gemv(x, w, b, block_n=8, block_k=32, split_k=3)
    assert _counters_zero(64)
    assert torch.equal(first, gemv(x, w, b, block_n=8, block_k=32, split_k=3))
