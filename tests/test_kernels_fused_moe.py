"""Fused MoE (``vtcore.kernels.fused_moe``): routing and the routed experts against plain torch.

Two oracles:

* ``fused_experts_ref`` / ``moe_route_ref``: the kernels' exact rounding points (module docstring)
  in plain loops. Only the float32 summation order (and, in the interpreter, numpy's vs torch's
  ``exp`` in the last float32 bit) differs, so float32 agrees within 1e-5 of the output's scale; a
  16-bit output within 1 ulp of |ref| + 1 ulp of max |ref| (a float32 sum straddling a rounding
  boundary), with >= 90% of the values bit-equal (a missing or extra rounding would move many).
* ``_model_moe``: ``SparseMoE`` / ``Experts.forward`` restated (F.linear or ``fp4_linear_reference``
  per expert, ``silu_and_mul``, ``index_add_`` of the ``x.dtype`` weighted outputs, experts in id
  order). In float32 it rounds nowhere else either: 1e-5. In bf16 it rounds each expert's output,
  product and partial sum: within 4 bf16 ulps of the output's scale.

The slot order of the final float32 sum is pinned bit-exactly by ``test_slots_summed_in_order``.

On CPU the kernels run in the Triton interpreter, whose ``tl.dot`` mishandles bf16 (see
``test_kernels_gemv.py``): the prefill (dot) path runs there in float32 / float16 only, the decode
(elementwise) path in bf16 too. Tiny shapes (E=8, H=64, I=32) with small forced blocks, so every
kernel loops over several N and K tiles (``test_partial_tiles``: H and I that leave the last ones
partial). The prefill grouping (``_align``) is checked on its own, as a wrong row there can hide
behind the interpreter's sequential programs. The CUDA section runs bf16 at
larger shapes, checks that no call syncs with the host, and replays the decode path in a graph.
"""
from __future__ import annotations

import math

import pytest
import torch
from torch.nn import functional as F

pytest.importorskip("triton")

from vtcore.kernels.fused_moe import (  # noqa: E402
    FP4Experts,
    _align,
    _align_ref,
    fused_experts,
    fused_experts_ref,
    moe_route,
    moe_route_ref,
)
from vtcore.kernels.rmsnorm import INTERPRET  # noqa: E402
from vtcore.layers.activation import silu_and_mul  # noqa: E402
from vtcore.kernels.fp4 import fp4_linear_reference  # noqa: E402

interp = pytest.mark.skipif(not INTERPRET, reason="CPU tensors need the Triton interpreter")
cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

E, H, I = 8, 64, 32
_TOL = {torch.float32: 1e-5, torch.float16: 2.0 ** -10, torch.bfloat16: 2.0 ** -7}
# Small forced blocks: decode (block_n, block_k); prefill (block_m, block_n, block_k).
_DECODE = dict(block_n=16, block_k=32)
_PREFILL = dict(block_m=16, block_n=16, block_k=16)
_PREFILL_FP4 = dict(block_m=16, block_n=16, block_k=32)


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _dense(dtype: torch.dtype, seed: int, e: int = E, h: int = H, i: int = I, device: str = "cpu"
           ) -> tuple[torch.Tensor, torch.Tensor]:
    g = _gen(seed)
    w_gate_up = torch.randn((e, 2 * i, h), generator=g) / math.sqrt(h)
    w_down = torch.randn((e, h, i), generator=g) / math.sqrt(i)
    return w_gate_up.to(dtype=dtype, device=device), w_down.to(dtype=dtype, device=device)


def _fp4(kind: str, seed: int, e: int = E, h: int = H, i: int = I, device: str = "cpu") -> FP4Experts:
    """Random codes and valid scale bytes, weights of rms about 1/sqrt(in) (as ``Experts._fp4_dummy_init``);
    NVFP4 global scales differ per expert and between gate and up."""
    g = _gen(seed)
    group = 16 if kind == "e4m3" else 32
    parts = []
    for rows, k, n_global in ((2 * i, h, 2), (h, i, 1)):
        packed = torch.randint(0, 256, (e, rows, k // 2), generator=g, dtype=torch.int32).to(torch.uint8)
        scale = torch.empty((e, rows, k // group)).uniform_(0.5, 2.0, generator=g) / (2.93 * math.sqrt(k))
        glob = None
        if kind == "e4m3":
            glob = torch.empty((e, n_global)).uniform_(16.0, 256.0, generator=g)
            scale = (scale * glob.repeat_interleave(rows // n_global, dim=1)[..., None]).to(torch.float8_e4m3fn)
        else:
            scale = (torch.log2(scale).round() + 127).to(torch.uint8)
        parts.append((packed.to(device), scale.to(device), None if glob is None else glob.to(device)))
    (gu_p, gu_s, gu_g), (d_p, d_s, d_g) = parts
    return FP4Experts(gu_p, gu_s, d_p, d_s, kind, group, gu_g, d_g)


def _routing(t: int, k: int, seed: int, e: int = E, device: str = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
    return moe_route_ref(torch.randn((t, e), generator=_gen(seed)).to(device), k)


def _x(t: int, dtype: torch.dtype, seed: int, device: str = "cpu", h: int = H) -> torch.Tensor:
    return torch.randn((t, h), generator=_gen(seed)).to(dtype=dtype, device=device)


def _close(y: torch.Tensor, ref: torch.Tensor) -> None:
    assert y.shape == ref.shape and y.dtype == ref.dtype
    tol = _TOL[y.dtype]
    err = (y.float() - ref.float()).abs()
    bound = tol * (ref.float().abs() + ref.float().abs().max())
    assert (err <= bound).all(), f"max err {err.max().item()} (bound there {bound.flatten()[err.argmax()].item()})"
    if y.dtype != torch.float32:
        assert (y == ref).float().mean().item() >= 0.9, (y != ref).float().mean().item()


def _model_linear(x: torch.Tensor, which: str, e: int, dense: torch.Tensor | None, fp4: FP4Experts | None
                  ) -> torch.Tensor:
    """``Experts``' per-expert projection: F.linear, or ``fp4_linear_reference`` with per-row globals."""
    if fp4 is None:
        return F.linear(x, dense[e])
    packed, scale = getattr(fp4, f"{which}_packed")[e], getattr(fp4, f"{which}_scale")[e]
    glob = getattr(fp4, f"{which}_global_scale")
    row_global = None if glob is None else glob[e].repeat_interleave(packed.shape[0] // glob.shape[1])
    return fp4_linear_reference(x, packed, scale, fp4.scale_kind, row_global, fp4.group_size)


def _model_experts(x: torch.Tensor, experts: torch.Tensor, weights: torch.Tensor, w_gate_up: torch.Tensor | None,
                   w_down: torch.Tensor | None, fp4: FP4Experts | None = None) -> torch.Tensor:
    """``Experts.forward``: per expert in id order, its tokens' MLP, weighted, ``index_add_``-ed."""
    out = torch.zeros_like(x)
    for e in experts.unique().tolist():
        token, slot = torch.where(experts == e)
        h = silu_and_mul(_model_linear(x[token], "gate_up", e, w_gate_up, fp4))
        out.index_add_(0, token, _model_linear(h, "down", e, w_down, fp4) * weights[token, slot, None])
    return out


def _model_moe(x: torch.Tensor, logits: torch.Tensor, k: int, w_gate_up: torch.Tensor | None,
               w_down: torch.Tensor | None, fp4: FP4Experts | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``SparseMoE.forward`` without its shared expert: (routed output, expert ids)."""
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
    top, experts = probs.topk(k, dim=-1)
    weights = (top / top.sum(dim=-1, keepdim=True)).to(x.dtype)
    return _model_experts(x, experts, weights, w_gate_up, w_down, fp4), experts


# ------------------------------------------------------------------------------------------ routing
@interp
@pytest.mark.parametrize("e,k,t,dtype", [(8, 2, 6, torch.float32), (8, 4, 5, torch.bfloat16),
                                         (384, 8, 3, torch.float32)])
def test_route_matches_torch(e, k, t, dtype):
    """Softmax / top-k / renormalise as ``SparseMoE`` (logits 0.05 apart: no near ties); E not a power of two."""
    g = _gen(e + k)
    logits = (torch.stack([torch.randperm(e, generator=g) for _ in range(t)]) * 0.05 - 3.0).to(dtype)
    ids, weights = moe_route(logits, k)
    ref_ids, ref_weights = moe_route_ref(logits, k)
    assert ids.dtype == torch.int32 and weights.dtype == torch.float32 and ids.shape == weights.shape == (t, k)
    assert torch.equal(ids, ref_ids)
    torch.testing.assert_close(weights, ref_weights, rtol=2e-6, atol=0)
    strided = torch.cat((logits, logits), dim=1)[:, :e]  # rows e * 2 apart
    assert torch.equal(moe_route(strided, k)[0], ids)


@interp
def test_route_ties_go_to_the_lowest_index():
    logits = torch.tensor([[0.0] * 8,
                           [0, 1, 1, 0, 1, 0, 0, 0],
                           [0, 0, 0, 0, 0, 0, 2, 2]])
    ids, weights = moe_route(logits, 4)
    assert ids.tolist() == [[0, 1, 2, 3], [1, 2, 4, 0], [6, 7, 0, 1]]
    assert torch.equal(weights[0], torch.full((4,), 0.25))
    assert weights[1, 0] == weights[1, 1] == weights[1, 2] > weights[1, 3]


# ------------------------------------------------------------------------------------- dense experts
@interp
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("t,k", [(1, 2), (3, 4)])
def test_decode_matches_reference(t, k, dtype):
    w_gate_up, w_down = _dense(dtype, seed=t)
    x = _x(t, dtype, seed=10 + t)
    ids, weights = _routing(t, k, seed=20 + t)
    y = fused_experts(x, ids, weights, w_gate_up, w_down, path="decode", **_DECODE)
    _close(y, fused_experts_ref(x, ids, weights, w_gate_up, w_down))


@interp
@pytest.mark.parametrize("t,k,dtype,blocks", [(3, 2, torch.float32, _PREFILL), (40, 4, torch.float32, _PREFILL),
                                              (40, 4, torch.float16, {})])
def test_prefill_matches_reference(t, k, dtype, blocks):
    """T = 40, k = 4: 160 rows over 8 experts, most of them more than one BLOCK_M = 16 block."""
    w_gate_up, w_down = _dense(dtype, seed=t + k)
    x = _x(t, dtype, seed=30 + t)
    ids, weights = _routing(t, k, seed=40 + t)
    y = fused_experts(x, ids, weights, w_gate_up, w_down, path="prefill", **{"block_m": 16, **blocks})
    _close(y, fused_experts_ref(x, ids, weights, w_gate_up, w_down))


@interp
@pytest.mark.parametrize("t,dtype,path", [(2, torch.float32, "decode"), (2, torch.bfloat16, "decode"),
                                          (40, torch.float32, "prefill")])
def test_matches_the_model(t, dtype, path):
    """moe_route + fused_experts (default blocks and path) == SparseMoE's routing + Experts.forward."""
    k = 4
    w_gate_up, w_down = _dense(dtype, seed=50)
    x = _x(t, dtype, seed=51)
    logits = torch.randn((t, E), generator=_gen(52)).to(dtype)
    ids, weights = moe_route(logits, k)
    y = fused_experts(x, ids, weights, w_gate_up, w_down)
    ref, experts = _model_moe(x, logits, k, w_gate_up, w_down)
    assert torch.equal(ids, experts.to(torch.int32))
    scale = 4 * 2.0 ** -8 if dtype == torch.bfloat16 else 1e-5
    bound = scale * (ref.float().abs() + ref.float().abs().max())
    assert ((y.float() - ref.float()).abs() <= bound).all(), (y.float() - ref.float()).abs().max().item()


@interp
def test_repeated_and_unselected_experts():
    """Experts shared by many tokens (expert 3 by all 18, in slot 0: two BLOCK_M blocks), a token
    choosing one expert twice, experts 0, 2, 4, 7 chosen by nobody."""
    t = 18
    w_gate_up, w_down = _dense(torch.float32, seed=60)
    x = _x(t, torch.float32, seed=61)
    ids = torch.stack((torch.full((t,), 3), torch.tensor([5, 1, 6] * 6)), dim=1).to(torch.int32)
    ids[4, 1] = 3
    weights = torch.rand((t, 2), generator=_gen(62))
    ref = fused_experts_ref(x, ids, weights, w_gate_up, w_down)
    _close(fused_experts(x, ids, weights, w_gate_up, w_down, path="prefill", **_PREFILL), ref)
    _close(fused_experts(x[:3], ids[3:6], weights[:3], w_gate_up, w_down, path="decode", **_DECODE),
           fused_experts_ref(x[:3], ids[3:6], weights[:3], w_gate_up, w_down))
    _close(fused_experts(x, ids, weights, w_gate_up, w_down), _model_experts(x, ids, weights, w_gate_up, w_down))


@interp
@pytest.mark.parametrize("kind,path,dtype,h,i", [
    (None, "decode", torch.bfloat16, 72, 40), (None, "prefill", torch.float32, 72, 40),
    ("e4m3", "decode", torch.float32, 80, 48), ("e8m0", "prefill", torch.float16, 96, 64)])
def test_partial_tiles(kind, path, dtype, h, i):
    """H and I not multiples of the blocks: the last N tile (rows clamped, stores masked) and the
    last K tile (masked; FP4: whole groups) of every kernel are partial."""
    t, k = 2, 2
    blocks = {"decode": dict(block_n=16, block_k=32 if kind != "e8m0" else 64),
              "prefill": dict(block_m=16, block_n=16, block_k=16 if kind is None else 64)}[path]
    if kind is None:
        dense, fp4 = _dense(dtype, seed=h, h=h, i=i), None
    else:
        dense, fp4 = (None, None), _fp4(kind, seed=h, h=h, i=i)
    x = _x(t, dtype, seed=h + 1, h=h)
    ids, weights = _routing(t, k, seed=h + 2)
    y = fused_experts(x, ids, weights, *dense, fp4=fp4, path=path, **blocks)
    _close(y, fused_experts_ref(x, ids, weights, *dense, fp4=fp4, path=path))


@pytest.mark.parametrize("align", [_align_ref, pytest.param(_align, marks=interp)], ids=["torch", "triton"])
@pytest.mark.parametrize("t,k,block_m", [(40, 4, 16), (5, 2, 4), (1, 1, 16), (300, 8, 64)])
def test_align_groups_rows_by_expert(t, k, block_m, align):
    """The prefill grouping: each valid (token, slot) row exactly once, in the blocks of its expert,
    an expert's rows in (token, slot) order then padding (``n``); invalid ids (-1, E) in no block;
    used blocks first, in expert order, within the host bound ``T * k / BLOCK_M + E``. The Triton
    grouping (two launches) gives the torch reference's tensors exactly."""
    ids = torch.randint(-1, E + 1, (t, k), generator=_gen(t))
    ids[0, 0] = 3
    rows, block_expert, blocks = align(ids, E, block_m)
    n, flat = t * k, ids.flatten()
    assert blocks <= -(-n // block_m) + E and rows.shape == (blocks * block_m,) and block_expert.shape == (blocks,)
    assert rows.dtype == block_expert.dtype == torch.int32
    assert block_expert.tolist() == sorted(block_expert.tolist()) and int(block_expert.max()) <= E
    by_block = rows.view(blocks, block_m)
    for e in range(E + 1):
        got = by_block[block_expert == e].flatten()
        mine = (flat == e).nonzero().flatten() if e < E else torch.zeros(0, dtype=torch.long)
        pad = (-mine.numel()) % block_m if e < E else got.numel()
        assert got.tolist() == mine.tolist() + [n] * pad, e
    if align is _align:
        want = _align_ref(ids, E, block_m)
        assert torch.equal(rows, want[0]) and torch.equal(block_expert, want[1])


@interp
@pytest.mark.parametrize("path", ["decode", "prefill"])
def test_out_of_range_ids_contribute_nothing(path):
    """Ids -1 and E (unknown to the host without a sync) are skipped, whatever their weight (NaN here)."""
    t = 3
    w_gate_up, w_down = _dense(torch.float32, seed=70)
    x = _x(t, torch.float32, seed=71)
    ids = torch.tensor([[2, -1], [E, 6], [1, 2]])
    weights = torch.tensor([[0.7, float("nan")], [float("nan"), 0.4], [0.5, 0.5]])
    y = fused_experts(x, ids, weights, w_gate_up, w_down, path=path, **(_DECODE if path == "decode" else _PREFILL))
    kept = torch.tensor([[2, 6], [6, 6], [1, 2]])
    kept_weights = torch.tensor([[0.7, 0.0], [0.0, 0.4], [0.5, 0.5]])
    _close(y, fused_experts_ref(x, kept, kept_weights, w_gate_up, w_down))


@interp
def test_out_of_range_ids_contribute_nothing_fp4_decode():
    """FP4 decode reads the clamped expert 0 unmasked for an invalid slot and discards it: a NaN scale
    in expert 0 (byte 0x7f) must not reach the output of a slot that never picked it."""
    t = 3
    fp4 = _fp4("e4m3", seed=72)
    fp4.gate_up_scale.view(torch.uint8)[0, :, 0] = 0x7F  # e4m3 NaN
    fp4.down_scale.view(torch.uint8)[0, :, 0] = 0x7F
    x = _x(t, torch.float32, seed=73)
    ids = torch.tensor([[2, -1], [E, 6], [1, 2]])
    weights = torch.tensor([[0.7, 0.3], [0.6, 0.4], [0.5, 0.5]])
    y = fused_experts(x, ids, weights, None, None, fp4=fp4, path="decode", **_DECODE)
    kept = torch.tensor([[2, 6], [6, 6], [1, 2]])
    kept_weights = torch.tensor([[0.7, 0.0], [0.0, 0.4], [0.5, 0.5]])
    assert not torch.isnan(y).any()
    _close(y, fused_experts_ref(x, kept, kept_weights, None, None, fp4=fp4))


@interp
@pytest.mark.parametrize("path", ["decode", "prefill"])
def test_slots_summed_in_order(path):
    """Every expert maps x = e_0 to exactly 1 (gate 64 with silu(64) == 64 in float32, up 1/64,
    down 32 x 1/32), so out = ((0 + w0) + w1) + w2 in float32: weights (2^-24, 2^-24, 1) give
    1 + 2^-23, while any order adding 1 first gives 1 (1 + 2^-24 ties to even); (1, 2^-24, 2^-24)
    gives 1 in slot order and 1 + 2^-23 reversed."""
    w_gate_up = torch.zeros((E, 2 * I, H))
    w_gate_up[:, :I, 0], w_gate_up[:, I:, 0] = 64.0, 1 / 64
    w_down = torch.full((E, H, I), 1 / 32)
    x = torch.zeros((2, H))
    x[:, 0] = 1.0
    ids = torch.tensor([[0, 3, 5], [7, 1, 2]], dtype=torch.int32)
    tiny = 2.0 ** -24
    weights = torch.tensor([[tiny, tiny, 1.0], [1.0, tiny, tiny]])
    y = fused_experts(x, ids, weights, w_gate_up, w_down, path=path, **(_DECODE if path == "decode" else _PREFILL))
    expected = torch.tensor([1 + 2.0 ** -23, 1.0])[:, None].expand(2, H)
    assert torch.equal(y, expected), y[:, 0].tolist()
    assert torch.equal(fused_experts_ref(x, ids, weights, w_gate_up, w_down), expected)


@interp
@pytest.mark.parametrize("path", ["decode", "prefill"])
def test_deterministic(path):
    w_gate_up, w_down = _dense(torch.float16, seed=80)
    x = _x(2, torch.float16, seed=81)
    ids, weights = _routing(2, 2, seed=82)
    blocks = _DECODE if path == "decode" else _PREFILL
    y = fused_experts(x, ids, weights, w_gate_up, w_down, path=path, **blocks)
    assert torch.equal(y, fused_experts(x, ids, weights, w_gate_up, w_down, path=path, **blocks))


# --------------------------------------------------------------------------------------- FP4 experts
@interp
@pytest.mark.parametrize("kind", ["e4m3", "e8m0"])
@pytest.mark.parametrize("path,t,dtype", [("decode", 2, torch.float32), ("decode", 2, torch.bfloat16),
                                          ("prefill", 20, torch.float32), ("prefill", 3, torch.float16)])
def test_fp4_matches_reference(kind, path, t, dtype):
    """NVFP4 (e4m3 scales, global scales distinct for gate / up / down and per expert) and MXFP4:
    the reference decodes with ``dequantize_fp4`` (prefill: rounded to 16-bit x's dtype; decode:
    float32, the group-factored sum rounds no weight); in float32 also the model's per-expert
    ``fp4_linear_reference`` math."""
    k = 2
    fp4 = _fp4(kind, seed=90 + len(kind))
    x = _x(t, dtype, seed=91 + t)
    logits = torch.randn((t, E), generator=_gen(92 + t))
    ids, weights = moe_route(logits, k)
    blocks = _DECODE if path == "decode" else _PREFILL_FP4 if t < 16 else {}  # T = 20: the default blocks
    y = fused_experts(x, ids, weights, None, None, fp4=fp4, path=path, **blocks)
    _close(y, fused_experts_ref(x, ids, weights, None, None, fp4=fp4, path=path))
    if dtype == torch.float32:
        _close(y, _model_moe(x, logits, k, None, None, fp4)[0])


# ------------------------------------------------------------------------------------------ bad input
def test_bad_inputs_are_named():
    w_gate_up, w_down = _dense(torch.float32, seed=0)
    x = torch.zeros((3, H))
    ids = torch.zeros((3, 2), dtype=torch.int32)
    weights = torch.ones((3, 2))
    cases = [
        ((x[0], ids, weights, w_gate_up, w_down), {}, r"x has shape \(64,\).*\[T, H\]"),
        ((x.double(), ids, weights, w_gate_up, w_down), {}, r"x .*float64"),
        ((x, ids, weights, w_gate_up[:, :, :32], w_down), {}, r"w_gate_up .*\[E, 2I, H\] = \(8, 64, 64\)"),
        ((x, ids, weights, w_gate_up[:, :63], w_down), {}, r"w_gate_up has shape \(8, 63, 64\)"),
        ((x, ids, weights, w_gate_up, w_down[:, :, :16]), {}, r"w_down .*\[E, H, I\] = \(8, 64, 32\)"),
        ((x, ids, weights, w_gate_up, w_down.half()), {}, r"w_down .*float16.*\(8, 64, 32\) of float32"),
        ((x, ids[:2], weights, w_gate_up, w_down), {}, r"topk_ids .*\[T, k\] = \(3, 2\)"),
        ((x, torch.zeros((3, 9), dtype=torch.int32), weights, w_gate_up, w_down), {},
         r"topk_ids has shape \(3, 9\).*1 <= k <= E=8"),
        ((x, ids.float(), weights, w_gate_up, w_down), {}, r"topk_ids .*int32 or int64"),
        ((x, ids, weights[:, :1], w_gate_up, w_down), {}, r"topk_weights .*\[T, k\] = \(3, 2\)"),
        ((x, ids, weights, None, w_down), {}, r"dense w_gate_up and w_down"),
        ((x, ids, weights, w_gate_up, w_down), dict(path="fast"), r"path='fast'"),
        ((x, ids, weights, w_gate_up, w_down), dict(path="prefill", block_n=8), r"block_n=8"),
    ]
    nv, mx = _fp4("e4m3", seed=0), _fp4("e8m0", seed=0)
    fp4_cases = [
        (dict(gate_up_packed=nv.gate_up_packed[:, :, :16]), r"fp4.gate_up_packed .*\[E, 2I, H/2\] = \(8, 64, 32\)"),
        (dict(down_scale=nv.down_scale[:, :, :1]), r"fp4.down_scale .*\[E, H, I/16\] = \(8, 64, 2\)"),
        (dict(gate_up_global_scale=nv.gate_up_global_scale[:, :1]), r"fp4.gate_up_global_scale .*\[E, 2\] = \(8, 2\)"),
        (dict(scale_kind="e5m2"), r"scale_kind='e5m2'"),
        (dict(group_size=12), r"group_size=12"),
    ]
    for change, match in fp4_cases:
        cases.append(((x, ids, weights, None, None), dict(fp4=FP4Experts(**{**_fields(nv), **change})), match))
    cases += [
        ((x, ids, weights, None, None), dict(fp4=FP4Experts(**{**_fields(mx), "down_scale": mx.down_scale.float()})),
         r"fp4.down_scale .*of uint8"),
        ((x, ids, weights, None, None), dict(fp4=FP4Experts(**{**_fields(mx), "down_global_scale": torch.ones(E, 1)})),
         r"fp4.down_global_scale is given, but MXFP4"),
        ((x, ids, weights, w_gate_up, w_down), dict(fp4=nv), r"dense w_gate_up and w_down, or both None"),
        ((x, ids, weights, None, None), dict(fp4=mx, path="decode", block_k=16), r"block_k=16"),
    ]
    for args, kwargs, match in cases:
        with pytest.raises(ValueError, match=match):
            fused_experts(*args, **kwargs)
    with pytest.raises(ValueError, match=r"top_k=9: expected 1 <= top_k <= E=8"):
        moe_route(torch.zeros((2, E)), 9)
    with pytest.raises(ValueError, match=r"router_logits: shape \(8,\)"):
        moe_route(torch.zeros(E), 2)


def _fields(fp4: FP4Experts) -> dict:
    return {f: getattr(fp4, f) for f in ("gate_up_packed", "gate_up_scale", "down_packed", "down_scale",
                                         "scale_kind", "group_size", "gate_up_global_scale", "down_global_scale")}


@interp
def test_empty_batch():
    w_gate_up, w_down = _dense(torch.float32, seed=0)
    ids, weights = moe_route(torch.zeros((0, E)), 2)
    assert ids.shape == weights.shape == (0, 2)
    for path in ("decode", "prefill"):
        assert fused_experts(torch.zeros((0, H)), ids, weights, w_gate_up, w_down, path=path).shape == (0, H)


# ------------------------------------------------------------------------------------------------ CUDA
# Qwen3.5-MoE-like proportions, scaled down: E = 64 experts, k = 8, H = 512, I = 256.
CE, CK, CH, CI = 64, 8, 512, 256


@cuda
@pytest.mark.parametrize("t", [1, 16, 77])
@pytest.mark.parametrize("path", ["decode", "prefill"])
def test_cuda_bf16(t, path):
    w_gate_up, w_down = _dense(torch.bfloat16, seed=t, e=CE, h=CH, i=CI, device="cuda")
    x = _x(t, torch.bfloat16, seed=t + 1, device="cuda", h=CH)
    ids, weights = moe_route(torch.randn((t, CE), generator=_gen(t + 2)).to("cuda"), CK)
    y = fused_experts(x, ids, weights, w_gate_up, w_down, path=path)
    _close(y, fused_experts_ref(x, ids, weights, w_gate_up, w_down))
    assert torch.equal(y, fused_experts(x, ids, weights, w_gate_up, w_down, path=path))


@cuda
@pytest.mark.parametrize("kind", ["e4m3", "e8m0"])
@pytest.mark.parametrize("t", [1, 77])
def test_cuda_fp4(kind, t):
    fp4 = _fp4(kind, seed=t, e=CE, h=CH, i=CI, device="cuda")
    x = _x(t, torch.bfloat16, seed=t + 1, device="cuda", h=CH)
    ids, weights = moe_route(torch.randn((t, CE), generator=_gen(t + 2)).to("cuda"), CK)
    path = "decode" if t == 1 else "prefill"
    _close(fused_experts(x, ids, weights, None, None, fp4=fp4, path=path),
           fused_experts_ref(x, ids, weights, None, None, fp4=fp4, path=path))


@cuda
def test_cuda_no_host_sync_and_graph_replay():
    """Neither path syncs (sync debug mode 'error'); the decode path (routing included) replays in a
    CUDA graph on new inputs and equals the eager result."""
    w_gate_up, w_down = _dense(torch.bfloat16, seed=1, e=CE, h=CH, i=CI, device="cuda")
    fp4 = _fp4("e4m3", seed=2, e=CE, h=CH, i=CI, device="cuda")

    def step(x: torch.Tensor, logits: torch.Tensor, path: str) -> tuple[torch.Tensor, torch.Tensor]:
        ids, weights = moe_route(logits, CK)
        return (fused_experts(x, ids, weights, w_gate_up, w_down, path=path),
                fused_experts(x, ids, weights, None, None, fp4=fp4, path=path))

    for t, path in ((4, "decode"), (100, "prefill")):
        x = _x(t, torch.bfloat16, seed=t, device="cuda", h=CH)
        logits = torch.randn((t, CE), generator=_gen(t)).to(device="cuda", dtype=torch.bfloat16)
        step(x, logits, path)  # compile outside the checks
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            step(x, logits, path)
        finally:
            torch.cuda.set_sync_debug_mode("default")

    x = _x(4, torch.bfloat16, seed=5, device="cuda", h=CH)
    logits = torch.randn((4, CE), generator=_gen(6)).to(device="cuda", dtype=torch.bfloat16)
    step(x, logits, "decode")
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = step(x, logits, "decode")
    x.copy_(_x(4, torch.bfloat16, seed=7, device="cuda", h=CH))
    logits.copy_(torch.randn((4, CE), generator=_gen(8)))
    graph.replay()
    torch.cuda.synchronize()
    for got, want in zip(outs, step(x, logits, "decode")):
        assert torch.equal(got, want)
