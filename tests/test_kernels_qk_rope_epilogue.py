"""The qkv GEMV's q/k-norm, RoPE and KV-cache epilogue (``gemv_qk_rope``) against the two launches it
replaces: the projection (``gemv`` / ``gemv_rms_norm``) then ``qk_norm_rope`` with its cache write.

The epilogue rounds as those kernels do (with integer ops: see ``head_epilogue``), so the results
are equal, on the H200 too; only the float32 sum of squares of a head's norm is summed in another
register layout, which could in principle move a rounding. Caches start as a sentinel: the token's
slot must be written, no other.
"""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from vtcore.kernels.gemv import INTERPRET, gemv, gemv_qk_rope, gemv_rms_norm, supports  # noqa: E402
from vtcore.kernels.rope import QKRope, qk_norm_rope  # noqa: E402
from vtcore.layers.rotary import RotaryEmbedding  # noqa: E402
from test_kernels_gemv_fp4 import fp4_weight  # noqa: E402

interp = pytest.mark.skipif(not INTERPRET, reason="CPU tensors need the Triton interpreter")
cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
SENTINEL = 7.0


def operands(nq: int, nkv: int, hd: int, dtype: torch.dtype, device: str, norm: bool, slot: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    rot = RotaryEmbedding(hd, 64, 10000.0).to(device)
    weights = [(torch.rand(hd, generator=g) + 0.5).to(device, dtype) for _ in range(2)] if norm else [None, None]
    caches = [torch.full((8, nkv, hd), SENTINEL, dtype=dtype, device=device) for _ in range(2)]
    return QKRope(nq, nkv, hd, *weights, 1e-6, False, rot.cos_cache, rot.sin_cache,
                  torch.tensor([37], device=device), *caches, torch.tensor([slot], device=device))


def unfused(qkv: torch.Tensor, r: QKRope) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The projection's output through ``qk_norm_rope`` with the cache write, on copies of the caches."""
    qkv, kc, vc = qkv.clone(), r.k_cache.clone(), r.v_cache.clone()
    q, k, v = qkv.split([r.q_heads * r.head_dim, r.kv_heads * r.head_dim, r.kv_heads * r.head_dim], -1)
    qk_norm_rope(q.view(1, r.q_heads, r.head_dim), k.view(1, r.kv_heads, r.head_dim), r.q_weight, r.k_weight, r.eps,
                 r.cos_cache, r.sin_cache, r.positions, r.head_dim, r.zero_centered,
                 v=v.view(1, r.kv_heads, r.head_dim), k_cache=kc, v_cache=vc, slot_mapping=r.slot_mapping)
    return qkv, kc, vc


def check_equal(r: QKRope, fused: torch.Tensor, ref: tuple) -> None:
    qkv, kc, vc = ref
    for got, want in ((fused, qkv), (r.k_cache, kc), (r.v_cache, vc)):
        assert torch.equal(got, want)
    slot = int(r.slot_mapping)
    others = [s for s in range(r.k_cache.shape[0]) if s != slot]
    assert (r.k_cache[others] == SENTINEL).all() and (r.v_cache[others] == SENTINEL).all()
    if slot >= 0:
        assert not (r.k_cache[slot] == SENTINEL).any()


@interp
@pytest.mark.parametrize("kind", ["bf16", "fp32", "nvfp4"])
@pytest.mark.parametrize("norm,split,slot", [(True, 1, 3), (True, 2, 5), (False, 2, -1)])
def test_interpreter_epilogue_matches_two_launches(kind, norm, split, slot):
    nq, nkv, hd, k = 4, 2, 32, 128
    n = (nq + 2 * nkv) * hd
    dtype = torch.float32 if kind == "fp32" else torch.bfloat16
    x = torch.randn(1, k, generator=torch.Generator().manual_seed(1)).to(dtype)
    w = fp4_weight(n, k, "e4m3", seed=2) if kind == "nvfp4" else (torch.randn(n, k) / 8).to(dtype)
    bias = None if kind == "nvfp4" else torch.randn(n).to(dtype)
    r = operands(nq, nkv, hd, dtype, "cpu", norm, slot)
    cfg = dict(block_k=64 if kind == "nvfp4" else 32, split_k=split)
    ref = unfused(gemv(x, w, bias, block_n=hd, **cfg), r)
    qkv, new_residual = gemv_qk_rope(x, w, r, bias, **cfg)
    assert new_residual is None
    check_equal(r, qkv, ref)


@interp
def test_interpreter_epilogue_with_the_norm_prologue():
    """Dense weights: residual add + RMSNorm prologue, projection and the epilogue in one launch."""
    nq, nkv, hd, k = 2, 1, 32, 64
    g = torch.Generator().manual_seed(3)
    x, res = torch.randn(1, k, generator=g).bfloat16(), torch.randn(1, k, generator=g).bfloat16()
    nw = (torch.rand(k, generator=g) + 0.5).bfloat16()
    w = (torch.randn((nq + 2 * nkv) * hd, k, generator=g) / 8).bfloat16()
    r = operands(nq, nkv, hd, torch.bfloat16, "cpu", True, 0)
    y, h = gemv_rms_norm(x, res, nw, 1e-6, w, block_n=hd, block_k=32)
    ref = unfused(y, r)
    qkv, h2 = gemv_qk_rope(x, w, r, None, res, nw, 1e-6, block_k=32)
    assert torch.equal(h2, h)
    check_equal(r, qkv, ref)


@interp
def test_operands_that_do_not_fit_are_refused():
    r = operands(4, 2, 32, torch.bfloat16, "cpu", True, 0)
    x, w = torch.randn(1, 64).bfloat16(), torch.randn(256, 64).bfloat16()
    assert r.fits(x, 256) and supports(x, w, fused="qk_rope")
    assert not r.fits(x, 255) and not r.fits(torch.randn(2, 64).bfloat16(), 256)  # width; one token only
    assert not r.fits(x.float(), 256)  # caches and norm weights in another dtype
    partial = QKRope(4, 2, 32, None, None, 0.0, False, r.cos_cache[:, :16], r.sin_cache[:, :16], r.positions,
                     r.k_cache, r.v_cache, r.slot_mapping)
    assert not partial.fits(x, 256)  # RoPE over part of the head: the standalone kernel's job
    with pytest.raises(ValueError, match="do not fit"):
        gemv_qk_rope(x, torch.randn(192, 64).bfloat16(), r)
    with pytest.raises(ValueError, match="block_n=64"):
        gemv_qk_rope(x, w, r, block_n=64)


@cuda
@pytest.mark.parametrize("kind", ["bf16", "nvfp4"])
def test_cuda_qwen3_4b_shape(kind):
    """Qwen3-4B's qkv (32 q heads, 8 kv heads, head_dim 128, K 2560), the launch the engine makes
    (tensor cores for NVFP4), equal to the two launches; the same bits run to run."""
    nq, nkv, hd, k = 32, 8, 128, 2560
    n = (nq + 2 * nkv) * hd
    x = torch.randn(1, k, device="cuda").bfloat16()
    w = fp4_weight(n, k, "e4m3", seed=5, device="cuda") if kind == "nvfp4" else (torch.randn(n, k, device="cuda") / 50).bfloat16()
    for slot in (6, -1):
        r = operands(nq, nkv, hd, torch.bfloat16, "cuda", True, slot)
        ref = unfused(gemv(x, w, block_n=hd), r)
        qkv = gemv_qk_rope(x, w, r)[0]
        check_equal(r, qkv, ref)
        assert torch.equal(gemv_qk_rope(x, w, r)[0], qkv)
