"""Gated DeltaNet's gated RMSNorm kernel (``vtcore.kernels.gated_rmsnorm``) against the layer's torch
path: within 2 ulps of the output dtype (the float32 sum of squares is ordered differently; see
:mod:`vtcore.kernels.rmsnorm`), bit-equal on inputs whose sums are exact."""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from vtcore.kernels.gated_rmsnorm import gated_rms_norm  # noqa: E402
from vtcore.kernels.rmsnorm import INTERPRET  # noqa: E402
from vtcore.layers.gated_deltanet import GatedRMSNorm  # noqa: E402

interp = pytest.mark.skipif(not INTERPRET, reason="CPU tensors need the Triton interpreter")
cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
ULP = {torch.bfloat16: 2.0 ** -7, torch.float16: 2.0 ** -10, torch.float32: 2.0 ** -23}


def _case(rows: int, d: int, dtype: torch.dtype, device: str, grid: bool, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    if grid:  # multiples of 1/8 below 2: every square and sum is exact in float32
        x = torch.randint(-16, 17, (rows, d), generator=g) / 8
    else:
        x = torch.randn(rows, d, generator=g) * 3
    z = (torch.randn(rows, d + 8, generator=g) * 2).to(dtype)[:, 4:4 + d]  # strided rows
    norm = GatedRMSNorm(d, 1e-6)
    norm.weight.data = (torch.rand(d, generator=g) + 0.5).to(dtype)
    return x.to(device), z.to(device), norm.to(device)


def _check(x, z, norm, ulps: int) -> None:
    got = gated_rms_norm(x, z, norm.weight, norm.eps)
    cpu_norm = GatedRMSNorm(norm.weight.shape[0], norm.eps)  # the layer's torch path
    cpu_norm.weight.data = norm.weight.detach().cpu()
    ref = cpu_norm(x.cpu(), z.cpu()).to(got.device)
    assert got.dtype == z.dtype and got.shape == z.shape
    tol = ulps * ULP[z.dtype] * ref.float().abs() + 1e-6
    assert ((got.float() - ref.float()).abs() <= tol).all(), (got.float() - ref.float()).abs().max().item()


@interp
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("d", [128, 96])  # 96: a masked block
def test_interpreter_matches_the_layer(dtype, d):
    _check(*_case(5, d, dtype, "cpu", grid=False), ulps=2)
    x, z, norm = _case(3, d, dtype, "cpu", grid=True, seed=1)
    _check(x, z, norm, ulps=0 if dtype == torch.float32 else 1)  # exact sums: only silu's expf may differ


@interp
def test_interpreter_heads_layout_of_a_strided_gate():
    """z as Gated DeltaNet passes it: [tokens, heads, D], a view into the wider fused projection."""
    tokens, heads, d = 3, 4, 32
    g = torch.Generator().manual_seed(4)
    x = torch.randn(tokens * heads, d, generator=g)
    fused = torch.randn(tokens, 40 + heads * d, generator=g).to(torch.bfloat16)
    z = fused[:, 40:].view(tokens, heads, d)
    norm = GatedRMSNorm(d, 1e-6)
    norm.weight.data = (torch.rand(d, generator=g) + 0.5).to(torch.bfloat16)
    got = gated_rms_norm(x, z, norm.weight, norm.eps)
    assert torch.equal(got, gated_rms_norm(x, z.reshape(tokens * heads, d).contiguous(), norm.weight, norm.eps))
    _check(x, z.reshape(tokens * heads, d), norm, ulps=2)


@interp
def test_bad_operands_are_named():
    z = torch.randn(2, 16)
    with pytest.raises(ValueError, match=r"x \(2, 8\), z \(2, 16\)"):
        gated_rms_norm(torch.randn(2, 8), z, torch.ones(16), 1e-6)
    with pytest.raises(ValueError, match=r"weight \(16,\) torch.float16"):
        gated_rms_norm(torch.randn(2, 16), z, torch.ones(16, dtype=torch.float16), 1e-6)


@cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_cuda_matches_the_layer(dtype):
    _check(*_case(64, 128, dtype, "cuda", grid=False, seed=2), ulps=2)
