"""Paged-attention kernels (``vtcore.kernels.paged_attention``) against their torch references, and
the references against an independent oracle: float64 ``F.scaled_dot_product_attention`` over each
sequence's contiguous (un-paged) K/V, GQA expanded by hand, causal mask built from positions.

Caches are paged through shuffled block tables whose unused columns hold arbitrary valid ids.
Unwritten slots hold large finite garbage for the references (it would dominate any output that
read it) and NaN for the kernels (a kernel that loads one position past a context fails).

On CPU the kernels run in the Triton interpreter (tiny shapes; small splits force multi-split
decode). The interpreter's ``tl.dot`` is wrong for bfloat16 (it multiplies the raw bits), so
16-bit kernel coverage here is float16; bfloat16 at real shapes, CUDA graphs and determinism are
in the CUDA section at the end.
"""
from __future__ import annotations

import dataclasses
import os

import pytest
import torch
from torch.nn import functional as F

pytest.importorskip("triton")

from vtcore.kernels.paged_attention import (  # noqa: E402
    decode_num_splits,
    paged_decode_attention,
    paged_decode_attention_ref,
    paged_prefill_attention,
    paged_prefill_attention_ref,
    prefill_num_splits,
    write_kv_cache,
    write_kv_cache_ref,
)
from vtcore.kernels import paged_attention as pa  # noqa: E402
from vtcore.layers.attention import (  # noqa: E402
    Attention,
    AttentionMetadata,
    causal_attention,
    set_attention_metadata,
)
import triton  # noqa: E402
import triton.language as tl  # noqa: E402
from triton.language.extra.cuda import gdc_launch_dependents, globaltimer  # noqa: E402
from vtcore.kernels.pdl import pdl_launch  # noqa: E402
from vtcore.kernels.workspace import arrival_counters  # noqa: E402

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
# Kernels on CPU tensors need the interpreter; on a GPU machine the cuda tests below cover them.
interp = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="CPU tensors need the Triton interpreter")


@dataclasses.dataclass
class Paged:
    """A paged cache holding ``keys[b]``/``values[b]`` [ctx_b, kv_heads, dim] for each sequence."""

    keys: list[torch.Tensor]
    values: list[torch.Tensor]
    k_cache: torch.Tensor  # unwritten slots: finite garbage
    v_cache: torch.Tensor
    k_nan: torch.Tensor  # unwritten slots: NaN
    v_nan: torch.Tensor
    block_tables: torch.Tensor
    context_lens: torch.Tensor


def _paged(ctx_lens: list[int], kv_heads: int, dim: int, block_size: int, seed: int, *,
           dtype: torch.dtype = torch.float32, table_dtype: torch.dtype = torch.int32,
           device: str = "cpu") -> Paged:
    g = torch.Generator().manual_seed(seed)
    need = [-(-c // block_size) for c in ctx_lens]
    num_blocks = sum(need) + 3
    perm = torch.randperm(num_blocks, generator=g)
    tables = torch.randint(0, num_blocks, (len(ctx_lens), max(need) + 2), generator=g)  # extra columns: any valid id
    slots = num_blocks * block_size
    k_cache = 100 * torch.randn(slots, kv_heads, dim, generator=g)
    v_cache = 100 * torch.randn(slots, kv_heads, dim, generator=g)
    written = torch.zeros(slots, dtype=torch.bool)
    keys, values, first = [], [], 0
    for b, (c, n) in enumerate(zip(ctx_lens, need)):
        tables[b, :n] = perm[first:first + n]
        first += n
        pos = torch.arange(c)
        s = tables[b, pos // block_size] * block_size + pos % block_size
        keys.append(torch.randn(c, kv_heads, dim, generator=g).to(dtype))
        values.append(torch.randn(c, kv_heads, dim, generator=g).to(dtype))
        k_cache[s], v_cache[s], written[s] = keys[-1].float(), values[-1].float(), True
    nan = torch.tensor(float("nan"))
    to = dict(device=device, dtype=dtype)
    return Paged([k.to(device) for k in keys], [v.to(device) for v in values], k_cache.to(**to), v_cache.to(**to),
                 torch.where(written[:, None, None], k_cache, nan).to(**to),
                 torch.where(written[:, None, None], v_cache, nan).to(**to),
                 tables.to(device=device, dtype=table_dtype), torch.tensor(ctx_lens, device=device))


def _oracle(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scale: float) -> torch.Tensor:
    """float64 SDPA of ``q`` [qlen, heads, dim] at the last qlen of ``len(keys)`` positions."""
    qlen, heads, _ = q.shape
    ctx, kv_heads, dim = keys.shape
    if ctx == 0:
        return torch.zeros(qlen, heads, dim, dtype=torch.float64, device=q.device)
    rep = heads // kv_heads
    k = keys.double().repeat_interleave(rep, dim=1).transpose(0, 1)
    v = values.double().repeat_interleave(rep, dim=1).transpose(0, 1)
    pos = torch.arange(ctx - qlen, ctx, device=q.device)
    mask = torch.arange(ctx, device=q.device)[None, :] <= pos[:, None]
    return F.scaled_dot_product_attention(q.double().transpose(0, 1), k, v, attn_mask=mask, scale=scale).transpose(0, 1)


def _decode_q(seqs: int, heads: int, dim: int, seed: int, dtype: torch.dtype, device: str = "cpu") -> torch.Tensor:
    """[seqs, heads, dim] as a head-major transpose (non-contiguous)."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn(heads, seqs, dim, generator=g).to(device=device, dtype=dtype).transpose(0, 1)


def _varlen(qlens: list[int], heads: int, kv_heads: int, dim: int, seed: int, dtype: torch.dtype,
            device: str = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
    """(q [tokens, heads, dim] sliced out of a fused qkv row, query_start_loc)."""
    g = torch.Generator().manual_seed(seed)
    tokens = sum(qlens)
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * dim, generator=g).to(device=device, dtype=dtype)
    qsl = torch.tensor([0] + qlens, device=device).cumsum(0).to(torch.int32)
    return qkv[:, :heads * dim].view(tokens, heads, dim), qsl


def _prefill_oracle(q: torch.Tensor, qsl: torch.Tensor, pc: Paged, scale: float) -> torch.Tensor:
    out = torch.zeros(q.shape, dtype=torch.float64, device=q.device)
    bounds = qsl.tolist()
    for b in range(len(bounds) - 1):
        lo, hi = bounds[b], bounds[b + 1]
        if hi > lo:
            out[lo:hi] = _oracle(q[lo:hi], pc.keys[b], pc.values[b], scale)
    return out


# ----------------------------------------------------------------------------- cache write


@pytest.mark.parametrize("impl", [pytest.param(write_kv_cache, marks=interp), write_kv_cache_ref],
                         ids=["kernel", "ref"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_write_kv_cache_honours_strides_and_zeroes_the_rows_of_negative_slots(impl, dtype):
    """Each row to its slot; a padded row (slot -1) to none, its k and v zeroed in place (the from-zero
    attention reads them), every other row of the fused qkv buffer as it was."""
    g = torch.Generator().manual_seed(0)
    tokens, heads, kv_heads, dim, slots = 7, 4, 2, 32, 20
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * dim, generator=g).to(dtype)
    k = qkv[:, heads * dim:(heads + kv_heads) * dim].view(tokens, kv_heads, dim)
    v = qkv[:, (heads + kv_heads) * dim:].view(tokens, kv_heads, dim)
    slot_mapping = torch.tensor([5, -1, 19, 0, -1, 11, 12])  # -1: padded rows; 19 is the last slot
    # row 0 of each buffer guards the memory just before the cache, where slot -1 would land
    k_buf = torch.randn(1 + slots, kv_heads, dim, generator=g).to(dtype)
    v_buf = torch.randn(1 + slots, kv_heads, dim, generator=g).to(dtype)
    k_want, v_want, qkv_want = k_buf.clone(), v_buf.clone(), qkv.clone()
    for t, s in enumerate(slot_mapping.tolist()):
        if s >= 0:
            k_want[1 + s], v_want[1 + s] = k[t], v[t]
        else:
            qkv_want[t, heads * dim:] = 0
    impl(k, v, k_buf[1:], v_buf[1:], slot_mapping)
    assert torch.equal(k_buf, k_want) and torch.equal(v_buf, v_want)
    assert torch.equal(qkv, qkv_want)


# ----------------------------------------------------------------------------- references vs oracle


@pytest.mark.parametrize("heads,kv_heads", [(2, 2), (4, 2), (4, 1)])
def test_references_match_oracle(heads, kv_heads):
    dim, bs, scale = 16, 8, 0.3
    # decode: contexts on and across block boundaries, a single position and an empty row
    ctx = [1, 8, 17, 40, 0]
    pc = _paged(ctx, kv_heads, dim, bs, seed=heads * 10 + kv_heads, table_dtype=torch.int64)
    q = _decode_q(len(ctx), heads, dim, seed=1, dtype=torch.float32)
    got = paged_decode_attention_ref(q, pc.k_cache, pc.v_cache, pc.block_tables, pc.context_lens, scale, bs, 48)
    want = torch.stack([_oracle(q[b:b + 1], pc.keys[b], pc.values[b], scale)[0] for b in range(len(ctx))])
    torch.testing.assert_close(got.double(), want, atol=1e-5, rtol=1e-5)
    assert not got[4].any()
    # prefill: full prompt, chunk over cached context, decode row, empty sequence, block-aligned prompt
    qlens, ctx = [13, 6, 1, 0, 16], [13, 30, 21, 5, 16]
    pc = _paged(ctx, kv_heads, dim, bs, seed=7)
    q, qsl = _varlen(qlens, heads, kv_heads, dim, seed=2, dtype=torch.float32)
    got = paged_prefill_attention_ref(q, pc.k_cache, pc.v_cache, pc.block_tables, qsl, pc.context_lens, scale, bs,
                                      max(qlens), max(ctx))
    torch.testing.assert_close(got.double(), _prefill_oracle(q, qsl, pc, scale), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("heads,kv_heads", [(2, 2), (4, 2), (4, 1)])
def test_a_prompt_from_position_0_attends_over_its_own_kv_as_the_oracle(heads, kv_heads):
    """``causal_attention`` (a prompt's first chunk: ``AttentionMetadata.from_zero``) over q/k/v sliced out of
    a fused qkv row, as the layers hand them over; rows padded after the prompt change no real row."""
    dim, scale, tokens, padded = 16, 0.3, 13, 16
    g = torch.Generator().manual_seed(heads * 10 + kv_heads)
    qkv = torch.randn(padded, (heads + 2 * kv_heads) * dim, generator=g)
    q = qkv[:, :heads * dim].view(padded, heads, dim)
    k = qkv[:, heads * dim:(heads + kv_heads) * dim].view(padded, kv_heads, dim)
    v = qkv[:, (heads + kv_heads) * dim:].view(padded, kv_heads, dim)
    got = causal_attention(q, k, v, scale)
    assert got.shape == (padded, heads, dim)
    want = _oracle(q[:tokens], k[:tokens], v[:tokens], scale)
    torch.testing.assert_close(got[:tokens].double(), want, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got.double(), _oracle(q, k, v, scale), atol=1e-5, rtol=1e-5)


def test_a_padded_prompt_from_position_0_keeps_its_padded_rows_out_of_the_real_ones():
    """``Attention`` on a from-zero step whose rows past the prompt are padding (KV slot -1): their K/V, which
    no cache holds and no layer need keep finite, never reach a real row (NaN there: the real rows as the
    oracle has them)."""
    heads, kv_heads, dim, tokens, padded, scale = 4, 2, 16, 5, 8, 0.25
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(padded, h, dim, generator=g) for h in (heads, kv_heads, kv_heads))
    k[tokens:], v[tokens:] = float("nan"), float("inf")
    layer = Attention(heads, kv_heads, dim, scale)
    layer.k_cache, layer.v_cache, layer.block_size = torch.zeros(16, kv_heads, dim), torch.zeros(16, kv_heads, dim), 4
    slots = torch.tensor([3, 4, 5, 6, 7] + [-1] * (padded - tokens))
    set_attention_metadata(AttentionMetadata(slots, torch.tensor([[0, 1, 2]]), torch.tensor([padded]),
                                             torch.tensor([0, padded]), padded, padded, from_zero=True,
                                             state_tokens=torch.tensor([tokens])))  # (as the padded chunk path)
    try:
        out = layer(q, k, v).view(padded, heads, dim)

        class OwnAttend(Attention):  # a family's attention of its own kind keeps it on from-zero steps too
            def attend(self, q):
                return torch.full((q.shape[0], heads * dim), 7.0)

        own = OwnAttend(heads, kv_heads, dim, scale)
        own.k_cache, own.v_cache, own.block_size = layer.k_cache.clone(), layer.v_cache.clone(), 4
        assert torch.equal(own(q, k, v), torch.full((padded, heads * dim), 7.0))
    finally:
        set_attention_metadata(None)
    torch.testing.assert_close(out[:tokens].double(), _oracle(q[:tokens], k[:tokens], v[:tokens], scale),
                               atol=1e-5, rtol=1e-5)
    assert torch.equal(layer.k_cache[3:8], k[:tokens])  # the real rows cached; the padded ones nowhere


# ----------------------------------------------------------------------------- decode kernel


@pytest.mark.parametrize("heads,kv_heads,bs,split,table_dtype", [
    (2, 2, 8, 3, torch.int32),        # MHA, 3 splits striding 16-position tiles (2 blocks each)
    (4, 2, 16, 2, torch.int64),       # GQA 2, 2 splits, int64 tables
    (4, 1, 16, 1, torch.int32),       # GQA 4, one split: the single-kernel path
])
@pytest.mark.parametrize("early", [False, True], ids=["wait-first", "early-reads"])
@interp
def test_decode_kernel_matches_reference(heads, kv_heads, bs, split, table_dtype, early):
    """``early_reads`` peels each program's first tile (read before the PDL wait, its last position
    again after it): the same result, every tile and split boundary included."""
    dim, scale = 32, 0.2
    ctx = [1, 16, 33, 79, 0, 48]  # within a block, on block/split boundaries, past them, empty
    pc = _paged(ctx, kv_heads, dim, bs, seed=heads + bs, table_dtype=table_dtype)
    q = _decode_q(len(ctx), heads, dim, seed=3, dtype=torch.float32)
    max_ctx = 80  # grid sized beyond the batch's longest context, as in a captured graph
    out = paged_decode_attention(q, pc.k_nan, pc.v_nan, pc.block_tables, pc.context_lens, scale, bs, max_ctx,
                                 num_splits=split, block_n=16, early_reads=early)
    ref = paged_decode_attention_ref(q, pc.k_cache, pc.v_cache, pc.block_tables, pc.context_lens, scale, bs, max_ctx)
    assert out.shape == (len(ctx), heads, dim) and out.dtype == q.dtype
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    assert not out[4].any()


@interp
@pytest.mark.parametrize("values", [64, 128])
def test_decode_combine_in_chunks(monkeypatch, values):
    """The last-arriving split combines the partials a chunk of splits at a time with a running max:
    forced down to 1 or 2 splits a chunk, 5 splits still give the reference."""
    monkeypatch.setattr(pa, "_COMBINE_VALUES", values)  # chunk = values // (group 2 * dim 32)
    heads, kv_heads, dim, bs = 4, 2, 32, 8
    ctx = [79, 5, 40]
    pc = _paged(ctx, kv_heads, dim, bs, seed=values)
    q = _decode_q(len(ctx), heads, dim, seed=1, dtype=torch.float32) * 4  # peaked: the max matters
    out = paged_decode_attention(q, pc.k_nan, pc.v_nan, pc.block_tables, pc.context_lens, 0.3, bs, 80,
                                 num_splits=5, block_n=16)
    ref = paged_decode_attention_ref(q, pc.k_cache, pc.v_cache, pc.block_tables, pc.context_lens, 0.3, bs, 80)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


@interp
def test_decode_kernel_float16_and_out_argument():
    heads, kv_heads, dim, bs, scale = 4, 2, 32, 8, 32 ** -0.5
    ctx = [70, 9, 0]
    pc = _paged(ctx, kv_heads, dim, bs, seed=5, dtype=torch.float16)
    q = _decode_q(len(ctx), heads, dim, seed=4, dtype=torch.float16)
    buf = torch.full((len(ctx), heads * dim + 8), 7.0, dtype=torch.float16)
    out = buf[:, :heads * dim].view(len(ctx), heads, dim)
    ref = paged_decode_attention_ref(q, pc.k_cache, pc.v_cache, pc.block_tables, pc.context_lens, scale, bs, 70)
    for _ in range(2):  # the last-arriving split resets its counter: a second launch combines again
        buf[:, :heads * dim] = 7.0
        got = paged_decode_attention(q, pc.k_nan, pc.v_nan, pc.block_tables, pc.context_lens, scale, bs, 70, out,
                                     num_splits=2, block_n=32)
        assert got is out and (buf[:, heads * dim:] == 7).all()
        torch.testing.assert_close(out, ref, atol=2e-3, rtol=2e-3)
        assert not arrival_counters(torch.device("cpu"), len(ctx) * kv_heads)[:len(ctx) * kv_heads].any()


@interp
def test_decode_all_empty_and_split_heuristic():
    pc = _paged([0, 0], 2, 16, 8, seed=6)
    q = _decode_q(2, 2, 16, seed=6, dtype=torch.float32)
    for splits, early in ((3, False), (1, False), (3, True), (1, True)):  # no splits to reduce; no positions
        out = paged_decode_attention(q, pc.k_nan, pc.v_nan, pc.block_tables, pc.context_lens, 1.0, 8, 40,
                                     num_splits=splits, block_n=16, early_reads=early)
        assert torch.equal(out, torch.zeros_like(out))
    no_blocks = torch.zeros((2, 0), dtype=torch.int32)  # the kernel reads a row's entry 0 whatever the length
    out = paged_decode_attention(q, pc.k_nan, pc.v_nan, no_blocks, pc.context_lens, 1.0, 8, 40, num_splits=3,
                                 block_n=16)
    assert torch.equal(out, torch.zeros_like(out))
    assert decode_num_splits(1, 8, 32768) == 32  # batch 1: capped (programs past the context cost their start)
    assert decode_num_splits(4, 8, 32768) == 32 and decode_num_splits(8, 8, 32768) == 16  # 1024 programs
    assert decode_num_splits(1, 8, 100) == 2  # never more splits than tiles
    assert decode_num_splits(32, 8, 40960) == 4
    assert decode_num_splits(256, 8, 32768) == 1  # a big batch needs no splits: the single kernel
    with pytest.raises(ValueError, match="power of two"):
        paged_decode_attention(q, pc.k_nan, pc.v_nan, pc.block_tables, pc.context_lens, 1.0, 8, 40, block_n=24)
    with pytest.raises(ValueError, match="num_splits=0"):
        paged_decode_attention(q, pc.k_nan, pc.v_nan, pc.block_tables, pc.context_lens, 1.0, 8, 40, num_splits=0)
    with pytest.raises(TypeError, match="early_reads='yes': expected True or False"):
        paged_decode_attention(q, pc.k_nan, pc.v_nan, pc.block_tables, pc.context_lens, 1.0, 8, 40, early_reads="yes")


# ----------------------------------------------------------------------------- prefill kernel


@pytest.mark.parametrize("heads,kv_heads,bs,table_dtype", [
    (2, 2, 8, torch.int64), (4, 2, 16, torch.int32), (4, 1, 8, torch.int32),
])
@interp
def test_prefill_kernel_matches_reference(heads, kv_heads, bs, table_dtype):
    dim, scale = 32, 0.2
    # a full prompt over 3 query blocks; chunks over context cached by earlier chunks, whose query
    # blocks start at positions 30, 46, 62 and 15, 31 (one or two short of a key-tile boundary:
    # where the unmasked key range ends); a decode row; a sequence with no queries
    qlens, ctx = [37, 48, 1, 0, 17], [37, 78, 45, 9, 32]
    pc = _paged(ctx, kv_heads, dim, bs, seed=heads * 3 + bs, table_dtype=table_dtype)
    q, qsl = _varlen(qlens, heads, kv_heads, dim, seed=8, dtype=torch.float32)
    args = (qsl, pc.context_lens, scale, bs, max(qlens), max(ctx))
    ref = paged_prefill_attention_ref(q, pc.k_cache, pc.v_cache, pc.block_tables, *args)
    # key splits: 3 (splits whose first tiles are causal ones a row sees nothing of, splits with no tile),
    # and more splits than any block has tiles
    for splits in (1, 3, 7):
        out = paged_prefill_attention(q, pc.k_nan, pc.v_nan, pc.block_tables, *args, block_m=16, block_n=16,
                                      num_splits=splits)
        assert out.shape == q.shape and out.dtype == q.dtype
        torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


@interp
def test_prefill_splits_leave_padding_rows_unwritten_and_name_bad_counts():
    heads, kv_heads, dim, bs = 2, 1, 32, 8
    qlens, ctx = [3], [70]
    pc = _paged(ctx, kv_heads, dim, bs, seed=4)
    q, qsl = _varlen(qlens, heads, kv_heads, dim, seed=5, dtype=torch.float32)
    padded = torch.cat((q, torch.randn(5, heads, dim)))  # a graph bucket's padding rows after the real ones
    out = torch.full_like(padded, 7.0)
    args = (qsl, pc.context_lens, 0.3, bs, 8, 4096)
    paged_prefill_attention(padded, pc.k_nan, pc.v_nan, pc.block_tables, *args, out=out, block_m=16, block_n=16,
                            num_splits=4)
    torch.testing.assert_close(out[:3], paged_prefill_attention_ref(q, pc.k_cache, pc.v_cache, pc.block_tables,
                                                                    qsl, pc.context_lens, 0.3, bs, 3, 70))
    assert torch.equal(out[3:], torch.full_like(out[3:], 7.0))
    with pytest.raises(ValueError, match="num_splits=0"):
        paged_prefill_attention(q, pc.k_nan, pc.v_nan, pc.block_tables, *args, num_splits=0)
    cpu = torch.device("cpu")  # the heuristic on the H200's 132 SMs (the interpreter's count)
    assert prefill_num_splits(128, 32, 1, 2176, cpu) == 4  # a 128-token chunk after a 2048-token prefix
    assert prefill_num_splits(16, 32, 1, 40960, cpu) == 8  # capped
    assert prefill_num_splits(128, 32, 1, 300, cpu) == 1  # a short context: no split holds 4 tiles
    assert prefill_num_splits(2048, 32, 1, 2048, cpu) == 1  # a long prompt fills the chip already


@interp
def test_prefill_kernel_float16_default_blocks_and_out_argument():
    heads, kv_heads, dim, bs, scale = 4, 2, 32, 16, 32 ** -0.5
    qlens, ctx = [18, 5], [18, 40]
    pc = _paged(ctx, kv_heads, dim, bs, seed=9, dtype=torch.float16)
    q, qsl = _varlen(qlens, heads, kv_heads, dim, seed=10, dtype=torch.float16)
    out = torch.empty(sum(qlens), heads * dim, dtype=torch.float16).view(-1, heads, dim)
    args = (qsl, pc.context_lens, scale, bs, max(qlens), max(ctx))
    got = paged_prefill_attention(q, pc.k_nan, pc.v_nan, pc.block_tables, *args, out=out)
    assert got is out
    torch.testing.assert_close(out, paged_prefill_attention_ref(q, pc.k_cache, pc.v_cache, pc.block_tables, *args),
                               atol=2e-3, rtol=2e-3)


# ----------------------------------------------------------------------------- CUDA, real shapes


BF16 = dict(atol=1e-2, rtol=1e-2)  # bf16 output rounding (2^-8 relative) plus P rounded to bf16 before P @ V


def _check_decode(device: str, dtype: torch.dtype, heads: int, kv_heads: int, ctx: list[int], max_ctx: int,
                  tol: dict, **kw) -> torch.Tensor:
    dim, bs, scale = 128, 16, 128 ** -0.5
    pc = _paged(ctx, kv_heads, dim, bs, seed=len(ctx) + heads, dtype=dtype, device=device)
    q = _decode_q(len(ctx), heads, dim, seed=11, dtype=dtype, device=device)
    out = paged_decode_attention(q, pc.k_nan, pc.v_nan, pc.block_tables, pc.context_lens, scale, bs, max_ctx, **kw)
    ref = paged_decode_attention_ref(q, pc.k_cache, pc.v_cache, pc.block_tables, pc.context_lens, scale, bs, max_ctx)
    torch.testing.assert_close(out.float(), ref.float(), **tol)
    want = torch.stack([_oracle(q[b:b + 1], pc.keys[b], pc.values[b], scale)[0] for b in range(len(ctx))])
    torch.testing.assert_close(out.double(), want, **tol)
    return out


def _check_prefill(device: str, dtype: torch.dtype, heads: int, kv_heads: int, qlens: list[int], ctx: list[int],
                   tol: dict) -> None:
    dim, bs, scale = 128, 16, 128 ** -0.5
    pc = _paged(ctx, kv_heads, dim, bs, seed=sum(qlens), dtype=dtype, device=device)
    q, qsl = _varlen(qlens, heads, kv_heads, dim, seed=12, dtype=dtype, device=device)
    args = (qsl, pc.context_lens, scale, bs, max(qlens), max(ctx))
    out = paged_prefill_attention(q, pc.k_nan, pc.v_nan, pc.block_tables, *args)
    torch.testing.assert_close(out.float(), paged_prefill_attention_ref(q, pc.k_cache, pc.v_cache, pc.block_tables,
                                                                       *args).float(), **tol)
    torch.testing.assert_close(out.double(), _prefill_oracle(q, qsl, pc, scale), **tol)


@cuda
@pytest.mark.parametrize("heads,kv_heads", [(16, 8), (32, 8)])
def test_cuda_decode_bf16_real_shapes(heads, kv_heads):
    _check_decode("cuda", torch.bfloat16, heads, kv_heads, [5000], 5000, BF16)  # batch 1: 79 tiles on 79 splits
    ctx = [1000 + 137 * i for i in range(15)] + [0]
    _check_decode("cuda", torch.bfloat16, heads, kv_heads, ctx, 32768, BF16)  # batch 16, grid sized for 32k
    _check_decode("cuda", torch.bfloat16, heads, kv_heads, ctx, 3000, BF16, num_splits=1)  # single kernel
    _check_decode("cuda", torch.bfloat16, heads, kv_heads, ctx, 32768, BF16, early_reads=True)
    _check_decode("cuda", torch.bfloat16, heads, kv_heads, ctx, 3000, BF16, num_splits=1, early_reads=True)


@cuda
@pytest.mark.parametrize("heads,kv_heads", [(16, 8), (32, 8)])
def test_cuda_prefill_bf16_real_shapes(heads, kv_heads):
    _check_prefill("cuda", torch.bfloat16, heads, kv_heads, [1500], [1500], BF16)  # batch 1 prompt
    qlens = [300, 1, 512, 77, 1, 1000] + [1] * 10  # prompts, chunks over cached context, decode rows
    ctx = [300, 1200, 2048, 1077, 999, 1000] + [1000 + 50 * i for i in range(10)]
    _check_prefill("cuda", torch.bfloat16, heads, kv_heads, qlens, ctx, BF16)
    _check_prefill("cuda", torch.bfloat16, heads, kv_heads, [128], [2176], BF16)  # a hit's chunk: key splits
    _check_prefill("cuda", torch.bfloat16, heads, kv_heads, [16, 3], [5000, 70], BF16)  # 8 splits, some empty


@cuda
@pytest.mark.parametrize("heads,kv_heads,dim", [(32, 8, 128), (16, 8, 128), (16, 2, 256)])
def test_cuda_causal_attention_bf16_over_fused_qkv_views_matches_the_oracle(heads, kv_heads, dim):
    """A prompt from position 0 (``causal_attention``, SDPA's fused kernels) over views of a fused qkv row
    in bfloat16, as the layers hand them over; the path is taken (``fused_sdpa``)."""
    from vtcore.layers.attention import fused_sdpa

    tokens, scale = 1000, dim ** -0.5
    g = torch.Generator().manual_seed(heads + dim)
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * dim, generator=g).to("cuda", torch.bfloat16)
    q = qkv[:, :heads * dim].view(tokens, heads, dim)
    k = qkv[:, heads * dim:(heads + kv_heads) * dim].view(tokens, kv_heads, dim)
    v = qkv[:, (heads + kv_heads) * dim:].view(tokens, kv_heads, dim)
    assert fused_sdpa(q) and not fused_sdpa(q.float())
    got = causal_attention(q, k, v, scale)
    torch.testing.assert_close(got.double(), _oracle(q, k, v, scale), atol=2e-2, rtol=2e-2)


@cuda
def test_cuda_attention_compiles_no_variant_per_batch_shape():
    """Once each path ran (one split or several; decode, prefill), batches of other shapes compile
    nothing: the block table's width, the sequence count and the split count vary every step, and a
    kernel specialised on them (an int divisible by 16, or 1) stalled a served step for a compile. Heads
    16 / kv heads 2 (Qwen3.5's): no test before it in this file compiles that group size."""
    from vtcore.bench.step_stats import count_triton_compiles

    _check_prefill("cuda", torch.bfloat16, 16, 2, [1500], [1500], BF16)  # one split
    _check_prefill("cuda", torch.bfloat16, 16, 2, [128], [2176], BF16)  # key splits and their combine
    _check_decode("cuda", torch.bfloat16, 16, 2, [1000, 2000], 3000, BF16, num_splits=1)
    _check_decode("cuda", torch.bfloat16, 16, 2, [1000, 2000], 32768, BF16)
    with count_triton_compiles() as compiled:
        for qlens, ctx in (([1000], [1000]), ([300, 77], [990, 1077]), ([1] * 5, [16, 100, 1006, 7, 2000]),
                           ([16, 3], [5000, 70]), ([128], [1008]), ([128, 40], [2176, 40])):
            _check_prefill("cuda", torch.bfloat16, 16, 2, qlens, ctx, BF16)  # table widths 16..315 blocks
        for ctx in ([990], [1000, 17], [1, 2, 3, 4]):
            _check_decode("cuda", torch.bfloat16, 16, 2, ctx, 3000, BF16, num_splits=1)
            _check_decode("cuda", torch.bfloat16, 16, 2, ctx, 32768, BF16)
    assert compiled == []


@triton.jit
def _late_last_positions(k_src, v_src, k_dst, v_dst, slot_ptr, spin_ns, ROW: tl.constexpr):
    """Lets the kernel after it start at once (PDL), spins ``spin_ns``, then copies cache row
    ``slot_ptr[program]`` from the sources: a decode step's cache write, late."""
    gdc_launch_dependents()
    start = globaltimer()
    now = start
    while now - start < spin_ns:
        now = globaltimer()
    slot = tl.load(slot_ptr + tl.program_id(0)).to(tl.int64)
    offs = slot * ROW + tl.arange(0, ROW)
    tl.store(k_dst + offs, tl.load(k_src + offs))
    tl.store(v_dst + offs, tl.load(v_src + offs))


@cuda
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() < (9, 0),
                    reason="programmatic dependent launch needs sm_90")
def test_cuda_decode_early_reads_see_the_last_position_written_by_the_kernel_before(monkeypatch):
    """With ``early_reads`` the programs read their first K/V tile before the PDL wait; the kernel
    before (here one that lets them start, spins 200 us, then writes the last position) has not written
    it yet, so the tile holding that position must be read again after the wait. Batch 1 (256
    programs), the SM count pinned to the H200's so that the launch takes the early path on any GPU."""
    if not pdl_launch(torch.device("cuda")).get("PDL"):
        pytest.skip("programmatic dependent launch is off (VTCORE_PDL=0)")
    monkeypatch.setattr(pa, "num_sms", lambda device: 132)
    heads, kv_heads, dim, bs = 32, 8, 128, 16
    q = _decode_q(1, heads, dim, seed=22, dtype=torch.bfloat16, device="cuda")
    for ctx in (1088, 64, 1):  # the last position mid-tile (split 16 of 32), at a tile's end, alone
        pc = _paged([ctx], kv_heads, dim, bs, seed=ctx, dtype=torch.bfloat16, device="cuda")
        slot = pc.block_tables[0, (ctx - 1) // bs].long().view(1) * bs + (ctx - 1) % bs
        k_stale, v_stale = pc.k_cache.clone(), pc.v_cache.clone()
        k_stale[slot], v_stale[slot] = -3 * pc.k_cache[slot], 5 * pc.v_cache[slot]
        args = (pc.block_tables, pc.context_lens, dim ** -0.5, bs, 40960)
        want = paged_decode_attention_ref(q, pc.k_cache, pc.v_cache, *args)
        stale = paged_decode_attention_ref(q, k_stale, v_stale, *args)
        assert not torch.allclose(want.float(), stale.float(), **BF16)  # the late write matters
        for early in (True, False):
            for spin in (0, 200_000):  # both kernels compiled first: a compile between them would serialise them
                k_cache, v_cache = k_stale.clone(), v_stale.clone()
                torch.cuda.synchronize()
                _late_last_positions[(1,)](pc.k_cache, pc.v_cache, k_cache, v_cache, slot, spin, ROW=kv_heads * dim)
                out = paged_decode_attention(q, k_cache, v_cache, *args, early_reads=early)
            torch.cuda.synchronize()
            torch.testing.assert_close(out.float(), want.float(), **BF16)


@cuda
def test_cuda_write_kv_cache_bf16():
    g = torch.Generator().manual_seed(13)
    tokens, heads, kv_heads, dim, slots = 300, 16, 8, 128, 4096
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * dim, generator=g).to("cuda", torch.bfloat16)
    k = qkv[:, heads * dim:(heads + kv_heads) * dim].view(tokens, kv_heads, dim)
    v = qkv[:, (heads + kv_heads) * dim:].view(tokens, kv_heads, dim)
    slot_mapping = torch.randperm(slots, generator=g)[:tokens].cuda()
    slot_mapping[::7] = -1
    caches = [torch.randn(slots, kv_heads, dim, generator=g).to("cuda", torch.bfloat16) for _ in range(2)]
    caches += [c.clone() for c in caches]  # the same starting contents: unwritten slots must stay equal
    write_kv_cache(k, v, caches[0], caches[1], slot_mapping)
    write_kv_cache_ref(k, v, caches[2], caches[3], slot_mapping)
    assert torch.equal(caches[0], caches[2]) and torch.equal(caches[1], caches[3])


@cuda
def test_cuda_decode_arrivals_stress():
    """The last-arriving split combines: 300 graph replays (batch 1 at 128 splits, batch 16) are
    bit-identical to the eager launch and close to the reference."""
    heads, kv_heads, dim, bs = 16, 8, 128, 16
    for ctx, max_ctx in (([1088], 40960), ([1000 + 37 * i for i in range(16)], 4096)):
        pc = _paged(ctx, kv_heads, dim, bs, seed=len(ctx), dtype=torch.bfloat16, device="cuda")
        q = _decode_q(len(ctx), heads, dim, seed=3, dtype=torch.bfloat16, device="cuda")
        args = (q, pc.k_cache, pc.v_cache, pc.block_tables, pc.context_lens, dim ** -0.5, bs, max_ctx)
        eager = paged_decode_attention(*args)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = paged_decode_attention(*args)
        for _ in range(300):
            graph.replay()
            torch.cuda.synchronize()
            assert torch.equal(out, eager)
        torch.testing.assert_close(out, paged_decode_attention_ref(*args), **BF16)


@cuda
def test_cuda_decode_graph_replay_is_deterministic():
    """Captured once with the grid sized for 32k, replayed with new lengths and tables in place."""
    heads, kv_heads, dim, bs, seqs, max_ctx = 16, 8, 128, 16, 4, 32768
    scale = dim ** -0.5
    first = _paged([3000, 17, 1, 0], kv_heads, dim, bs, seed=14, dtype=torch.bfloat16, device="cuda")
    second = _paged([40, 2900, 0, 1000], kv_heads, dim, bs, seed=15, dtype=torch.bfloat16, device="cuda")
    k_cache = torch.zeros(max(first.k_cache.shape[0], second.k_cache.shape[0]), kv_heads, dim,
                          dtype=torch.bfloat16, device="cuda")
    v_cache = torch.zeros_like(k_cache)
    q = _decode_q(seqs, heads, dim, seed=16, dtype=torch.bfloat16, device="cuda")
    tables = torch.zeros(seqs, max_ctx // bs, dtype=torch.int32, device="cuda")
    lens = torch.zeros(seqs, dtype=torch.int64, device="cuda")
    out = torch.empty(seqs, heads, dim, dtype=torch.bfloat16, device="cuda")

    def load(pc: Paged) -> None:
        k_cache[:pc.k_cache.shape[0]].copy_(pc.k_cache)
        v_cache[:pc.v_cache.shape[0]].copy_(pc.v_cache)
        tables.zero_()
        tables[:, :pc.block_tables.shape[1]].copy_(pc.block_tables)
        lens.copy_(pc.context_lens)

    load(first)
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):  # warm-up compiles outside the capture
        paged_decode_attention(q, k_cache, v_cache, tables, lens, scale, bs, max_ctx, out)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        paged_decode_attention(q, k_cache, v_cache, tables, lens, scale, bs, max_ctx, out)
    for pc in (first, second, first):
        load(pc)
        graph.replay()
        ref = paged_decode_attention_ref(q, pc.k_cache, pc.v_cache, pc.block_tables, pc.context_lens, scale, bs,
                                         max_ctx)
        torch.testing.assert_close(out.float(), ref.float(), **BF16)
        again = paged_decode_attention(q, k_cache, v_cache, tables, lens, scale, bs, max_ctx)
        assert torch.equal(out, again)  # eager and replayed, bit for bit
