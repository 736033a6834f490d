"""Elementwise Triton kernels (RMSNorm, fused add + RMSNorm, q/k norm + RoPE, SwiGLU) against their
torch references.

Tolerances, and why:

* Inputs on the grid ``k / 8`` (``|k| <= 16``): every float32 sum of squares is exact, so the one
  thing the kernels do in another order than torch (the reduction) cannot show, and every other op
  is rounded as torch rounds it: RMSNorm, fused add + RMSNorm and norm + RoPE equal the references
  bit for bit, float32 and bfloat16 (interpreter). On CUDA (bf16) the same is expected (``rsqrt`` is
  ``rsqrt.approx`` in both, the mean a multiply by float32(1/N) in both); 1 ulp is allowed there.
* Random normal inputs: float32 within 1e-6 relative (1e-6 absolute where RoPE cancels); bfloat16
  at most 0.1% of the values off at all (an ``rsqrt`` argument off in its last float32 bit flips a
  bf16 rounding of ``h`` with probability ~2^-16; a missing intermediate rounding would change
  many), by 1 ulp (RMSNorm: 2, as ``w * h`` with |w| near 2 doubles a 1-ulp change of ``h``). In
  the interpreter none is off at the seeds used.
* SwiGLU: ``exp`` is numpy's in the interpreter and Sleef's in torch (CPU), which may differ in the
  last float32 bit: float32 within 1e-6 relative, bfloat16 as random normal inputs above.

On CPU the kernels run in the Triton interpreter (tiny shapes); the CUDA section at the end runs the
same checks at Qwen3-0.6B / 4B / Qwen3.5 shapes in bfloat16, and inside a CUDA graph.
"""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from vtcore.kernels.activation import silu_and_mul, silu_and_mul_ref  # noqa: E402
from vtcore.kernels.rmsnorm import (  # noqa: E402
    INTERPRET,
    fused_add_rms_norm,
    fused_add_rms_norm_ref,
    rms_norm,
    rms_norm_ref,
)
from vtcore.kernels.rope import qk_norm_rope, qk_norm_rope_ref  # noqa: E402
from vtcore.layers import activation, norm  # noqa: E402
from vtcore.layers.rotary import RotaryEmbedding  # noqa: E402

interp = pytest.mark.skipif(not INTERPRET, reason="CPU tensors need the Triton interpreter")
cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
DTYPES = [torch.float32, torch.bfloat16]
EPS = 1e-6


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _grid(shape: tuple[int, ...], dtype: torch.dtype, g: torch.Generator, device: str = "cpu") -> torch.Tensor:
    """Values k / 8, |k| <= 16: exact in bf16, and any sum of their squares is exact in float32."""
    return (torch.randint(-16, 17, shape, generator=g) / 8).to(dtype=dtype, device=device)


def _randn(shape: tuple[int, ...], dtype: torch.dtype, g: torch.Generator, device: str = "cpu",
           scale: float = 1.0) -> torch.Tensor:
    return (scale * torch.randn(shape, generator=g)).to(dtype=dtype, device=device)


def _weight(n: int, dtype: torch.dtype, g: torch.Generator, zero_centered: bool, device: str = "cpu"
            ) -> torch.Tensor:
    return ((0.0 if zero_centered else 1.0) + 0.25 * torch.randn(n, generator=g)).to(dtype=dtype, device=device)


def _ordered(t: torch.Tensor) -> torch.Tensor:
    """Float bits as integers in the floats' order, so a difference counts ulps."""
    bits = t.view({torch.bfloat16: torch.int16, torch.float32: torch.int32}[t.dtype]).long()
    return torch.where(bits < 0, -(bits & (2 ** (8 * t.element_size() - 1) - 1)), bits)


def _assert_ulps(out: torch.Tensor, ref: torch.Tensor, ulps: int = 0, frac: float = 0.0) -> None:
    """Every value within ``ulps`` of the reference, at most a fraction ``frac`` of them off at all."""
    assert out.dtype == ref.dtype and out.shape == ref.shape, (out.dtype, ref.dtype, out.shape, ref.shape)
    d = (_ordered(out) - _ordered(ref)).abs()
    off = int((d > 0).sum())
    assert d.max().item() <= ulps and off <= frac * d.numel(), (
        f"{off}/{d.numel()} differ, max {d.max().item()} ulps; "
        f"e.g. {out[d > 0][:4].tolist()} vs {ref[d > 0][:4].tolist()}")


def _assert_close(out: torch.Tensor, ref: torch.Tensor, atol: float = 0.0, ulps: int = 1) -> None:
    """float32: 1e-6 relative; bfloat16: ``ulps``, at most 0.1% of the values off."""
    if out.dtype == torch.float32:
        torch.testing.assert_close(out, ref, rtol=1e-6, atol=atol)
    else:
        _assert_ulps(out, ref, ulps, frac=1e-3)


# ------------------------------------------------------------------------------------- checks


def _check_rms_norm(device: str, dtype: torch.dtype, tokens: int, hidden: int, zero_centered: bool, exact: bool,
                    seed: int = 0, ulps: int = 0, weight_dtype: torch.dtype | None = None) -> None:
    g = _gen(seed)
    make = _grid if exact else _randn
    wide = make((tokens, hidden + 48), dtype, g, device)
    x = wide[:, 16:16 + hidden]  # strided rows
    residual = make((tokens, hidden), dtype, g, device)
    w = _weight(hidden, weight_dtype or dtype, g, zero_centered, device)
    x0, r0 = x.clone(), residual.clone()
    # normal inputs, bf16: a flipped rounding of h can move ``w * h`` by 2 ulps (|w| near 2)
    cmp = (lambda o, r: _assert_ulps(o, r, ulps)) if exact else (lambda o, r: _assert_close(o, r, ulps=2))
    cmp(rms_norm(x, w, EPS, zero_centered), rms_norm_ref(x, w, EPS, zero_centered))
    out, new_residual = fused_add_rms_norm(x, residual, w, EPS, zero_centered)
    ref_out, ref_residual = fused_add_rms_norm_ref(x, residual, w, EPS, zero_centered)
    _assert_ulps(new_residual, ref_residual)  # one rounded add: always exact
    cmp(out, ref_out)
    assert torch.equal(x, x0) and torch.equal(residual, r0), "out of place: inputs untouched"


def _qk_views(buf: torch.Tensor, nq: int, nkv: int, d: int, gated: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """q [tokens, nq, d] and k [tokens, nkv, d] as views into a fused projection output ``buf``, as the
    models take them. ``gated``: Qwen3.5's [q0 | gate0 | q1 | gate1 ... | k | v] (q's head stride 2d)."""
    qw = (2 if gated else 1) * nq * d
    return buf[:, :qw].view(len(buf), nq, -1)[..., :d], buf[:, qw:qw + nkv * d].view(len(buf), nkv, d)


def _check_rope(device: str, dtype: torch.dtype, tokens: int, nq: int, nkv: int, d: int, rot: int, has_norm: bool,
                zero_centered: bool, gated: bool, exact: bool, seed: int = 0, ulps: int = 0,
                pos_dtype: torch.dtype = torch.int64, random_cache: bool = False, write_kv: bool = False) -> None:
    """``random_cache``: random cos/sin (RotaryEmbedding's repeat one half), so that a kernel reading
    the wrong half shows. ``write_kv``: the fused KV-cache write too (token 1 skipped with slot -1),
    which must store exactly the rotated k and the v of each token and touch no other slot, and zero
    token 1's k and v in place."""
    g = _gen(seed)
    width = ((2 if gated else 1) * nq + 2 * nkv) * d + 8  # + 8: padded rows
    buf = (_grid if exact else _randn)((tokens, width), dtype, g, device)
    q, k = _qk_views(buf, nq, nkv, d, gated)
    qw, kw = (_weight(d, dtype, g, zero_centered, device) for _ in range(2)) if has_norm else (None, None)
    if random_cache:
        cos, sin = torch.rand(4096, rot, generator=g), torch.rand(4096, rot, generator=g)
    else:
        rope = RotaryEmbedding(rot, 4096, 10000.0)
        cos, sin = rope.cos_cache, rope.sin_cache
    # unordered, repeated and non-contiguous positions
    positions = torch.randint(0, 4096, (2 * tokens,), generator=g).to(device=device, dtype=pos_dtype)[::2]
    positions[-1] = positions[0]
    args = (qw, kw, EPS, cos.to(device), sin.to(device), positions, rot, zero_centered)
    expect = buf.clone()  # the buffer with q and k replaced by the reference's
    for view, ref in zip(_qk_views(expect, nq, nkv, d, gated), qk_norm_rope_ref(q.clone(), k.clone(), *args)):
        view.copy_(ref)
    cache = {}
    if write_kv:
        v = buf[:, width - 8 - nkv * d:width - 8].view(tokens, nkv, d)
        k_cache, v_cache = (torch.full((3 * tokens, nkv, d), 77.0, dtype=dtype, device=device) for _ in range(2))
        slots = torch.arange(tokens, device=device) * 2 + 1
        slots[1 % tokens] = -1
        cache = dict(v=v, k_cache=k_cache, v_cache=v_cache, slot_mapping=slots)
        _qk_views(expect, nq, nkv, d, gated)[1][1 % tokens] = 0
        expect[1 % tokens, width - 8 - nkv * d:width - 8] = 0
    q_out, k_out = qk_norm_rope(q, k, *args, **cache)
    assert q_out is q and k_out is k
    if exact:
        _assert_ulps(buf, expect, ulps)
    else:
        _assert_close(buf, expect, atol=1e-6)
    if write_kv:
        written = slots >= 0
        assert torch.equal(k_cache[slots[written]], k[written]) and torch.equal(v_cache[slots[written]], v[written])
        untouched = torch.ones(3 * tokens, dtype=torch.bool, device=device)
        untouched[slots[written]] = False
        assert (k_cache[untouched] == 77).all() and (v_cache[untouched] == 77).all()


def _check_silu(device: str, dtype: torch.dtype, tokens: int, inter: int, seed: int = 0) -> None:
    g = _gen(seed)
    x = _randn((tokens, 2 * inter + 24), dtype, g, device, scale=3.0)[:, 8:8 + 2 * inter]  # strided rows
    _assert_close(silu_and_mul(x), silu_and_mul_ref(x))


# ------------------------------------------------------------------------------ CPU (interpreter)


@interp
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("zero_centered", [False, True])
def test_rms_norm_exact(dtype, zero_centered):
    _check_rms_norm("cpu", dtype, tokens=5, hidden=128, zero_centered=zero_centered, exact=True)


@interp
@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_random_masked_row(dtype):
    """hidden 96: a masked 128-wide block; normal inputs (rounding order differences can show)."""
    _check_rms_norm("cpu", dtype, tokens=4, hidden=96, zero_centered=False, exact=False, seed=1)


@interp
@pytest.mark.parametrize("zero_centered", [False, True])
def test_rms_norm_float32_weight(zero_centered):
    """bf16 x, float32 weight: ``weight * h.to(bf16)`` promotes to float32 (the output's dtype is
    checked against the reference's); zero-centred casts back to bf16."""
    _check_rms_norm("cpu", torch.bfloat16, 3, 64, zero_centered, exact=True, weight_dtype=torch.float32)


def test_rms_norm_reference_is_the_layer():
    layer = norm.RMSNorm(32, EPS, zero_centered=True)
    layer.weight.data = _weight(32, torch.bfloat16, _gen(4), True)
    x, r = _randn((3, 32), torch.bfloat16, _gen(5)), _randn((3, 32), torch.bfloat16, _gen(6))
    assert torch.equal(layer(x), rms_norm_ref(x, layer.weight, EPS, True))
    for a, b in zip(layer(x, r), fused_add_rms_norm_ref(x, r, layer.weight, EPS, True)):
        assert torch.equal(a, b)


ROPE_CASES = {  # (head_dim, rotary_dim, norm, zero_centered, gated)
    "qwen3": (64, 64, True, False, False),
    "qwen3.5-partial-gated": (64, 32, True, True, True),
    "llama-no-norm": (32, 32, False, False, False),
    "partial-no-norm": (64, 16, False, False, False),
}


@interp
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", list(ROPE_CASES))
@pytest.mark.parametrize("write_kv", [False, True])
def test_qk_norm_rope_exact(dtype, case, write_kv):
    d, rot, has_norm, zc, gated = ROPE_CASES[case]
    _check_rope("cpu", dtype, tokens=3, nq=4, nkv=2, d=d, rot=rot, has_norm=has_norm, zero_centered=zc,
                gated=gated, exact=True, pos_dtype=torch.int32 if case == "llama-no-norm" else torch.int64,
                write_kv=write_kv)


@interp
@pytest.mark.parametrize("dtype", DTYPES)
def test_qk_norm_rope_random(dtype):
    _check_rope("cpu", dtype, tokens=3, nq=2, nkv=1, d=64, rot=32, has_norm=True, zero_centered=False,
                gated=False, exact=False, seed=7, random_cache=True)


@interp
@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_and_mul(dtype):
    """I = 1100: two 1024-wide programs a row, the second masked."""
    _check_silu("cpu", dtype, tokens=3, inter=1100)


def test_silu_and_mul_reference_is_the_layer():
    x = _randn((3, 64), torch.bfloat16, _gen(8))
    assert torch.equal(silu_and_mul_ref(x), activation.silu_and_mul(x))


# ------------------------------------------------------------------------------------------ CUDA

SHAPES = {"qwen3-0.6b": (1024, 16, 8, 3072), "qwen3-4b": (2560, 32, 8, 9728)}  # hidden, heads, kv heads, I


@cuda
@pytest.mark.parametrize("tokens", [1, 7, 32])
@pytest.mark.parametrize("model", list(SHAPES))
def test_cuda_bf16(model, tokens):
    hidden, nq, nkv, inter = SHAPES[model]
    bf = torch.bfloat16
    for zc in (False, True):
        _check_rms_norm("cuda", bf, tokens, hidden, zc, exact=True, ulps=1)
        _check_rms_norm("cuda", bf, tokens, hidden, zc, exact=False, seed=1)
    _check_rope("cuda", bf, tokens, nq, nkv, 128, 128, True, False, gated=False, exact=True, ulps=1)
    _check_rope("cuda", bf, tokens, nq, nkv, 128, 128, False, False, gated=False, exact=True)  # no norm: exact
    _check_rope("cuda", bf, tokens, 8, 2, 256, 64, True, True, gated=True, exact=True, ulps=1)  # Qwen3.5 attention
    _check_silu("cuda", bf, tokens, inter)


@cuda
def test_cuda_graph_replay():
    """All four kernels captured in one CUDA graph, replayed on new inputs (copied into the captured ones)."""
    bf, dev, g = torch.bfloat16, "cuda", _gen(9)
    t, hidden, nq, nkv, d, inter = 4, 1024, 16, 8, 128, 3072
    rope = RotaryEmbedding(d, 4096, 1e6)
    cos, sin = rope.cos_cache.to(dev), rope.sin_cache.to(dev)
    x, r = _grid((t, hidden), bf, g, dev), _grid((t, hidden), bf, g, dev)
    w, qw, kw = _weight(hidden, bf, g, False, dev), _weight(d, bf, g, False, dev), _weight(d, bf, g, False, dev)
    qkv = _grid((t, (nq + 2 * nkv) * d), bf, g, dev)
    gu = _randn((t, 2 * inter), bf, g, dev)
    pos = torch.arange(t, device=dev)

    def step() -> tuple[torch.Tensor, ...]:
        q, k = qkv[:, :nq * d].view(t, nq, d), qkv[:, nq * d:(nq + nkv) * d].view(t, nkv, d)
        qk_norm_rope(q, k, qw, kw, EPS, cos, sin, pos, d)
        return (rms_norm(x, w, EPS), *fused_add_rms_norm(x, r, w, EPS), silu_and_mul(gu))

    step()  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = step()
    for src, dst in ((_grid((t, hidden), bf, g, dev), x), (_grid((t, (nq + 2 * nkv) * d), bf, g, dev), qkv),
                     (torch.tensor([9, 3, 4000, 3], device=dev), pos), (_randn((t, 2 * inter), bf, g, dev), gu)):
        dst.copy_(src)
    q0 = qkv.clone()
    graph.replay()
    ref_q, ref_k = qk_norm_rope_ref(q0[:, :nq * d].view(t, nq, d), q0[:, nq * d:(nq + nkv) * d].view(t, nkv, d),
                                    qw, kw, EPS, cos, sin, pos, d)
    _assert_ulps(qkv[:, :nq * d].view(t, nq, d), ref_q, 1)
    _assert_ulps(qkv[:, nq * d:(nq + nkv) * d].view(t, nkv, d), ref_k, 1)
    for out, ref in zip(outs, (rms_norm_ref(x, w, EPS), *fused_add_rms_norm_ref(x, r, w, EPS), silu_and_mul_ref(gu))):
        _assert_ulps(out, ref, 1, frac=1e-3)


@interp
def test_bad_operands_are_named():
    with pytest.raises(ValueError, match=r"weight \(16,\)"):
        rms_norm(torch.randn(2, 24), torch.randn(16), 1e-6)
    with pytest.raises(ValueError, match=r"residual \(3, 24\)"):
        fused_add_rms_norm(torch.randn(2, 24), torch.randn(3, 24), torch.randn(24), 1e-6)
    q, k = torch.randn(2, 4, 16), torch.randn(2, 2, 16)
    rope_args = (None, None, 1e-6, torch.ones(8, 16), torch.zeros(8, 16), torch.zeros(2, dtype=torch.long), 16)
    with pytest.raises(ValueError, match="give all or none"):
        qk_norm_rope(q, k, *rope_args, v=torch.randn(2, 2, 16))
    with pytest.raises(ValueError, match=r"k_cache \(9, 2, 8\)"):
        qk_norm_rope(q, k, *rope_args, v=torch.randn(2, 2, 16), k_cache=torch.zeros(9, 2, 8),
                     v_cache=torch.zeros(9, 2, 8), slot_mapping=torch.zeros(2, dtype=torch.long))


def test_pdl_setting(monkeypatch):
    """VTCORE_PDL: 0 turns programmatic dependent launch off without asking the GPU; a bad value is
    named; CPU launches never use it."""
    from vtcore.kernels import pdl
    assert pdl.pdl_launch(torch.device("cpu")) == {"PDL": False}
    monkeypatch.setenv(pdl.ENV, "0")
    assert pdl._enabled.__wrapped__(0) is False
    monkeypatch.setenv(pdl.ENV, "maybe")
    with pytest.raises(ValueError, match="VTCORE_PDL='maybe'"):
        pdl._enabled.__wrapped__(0)
