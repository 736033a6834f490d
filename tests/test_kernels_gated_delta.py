"""Gated DeltaNet kernels (``vtcore.kernels.gated_delta``) against the torch rule and layer math.

References: ``gated_delta_recurrent`` / ``gated_delta_chunked`` (vtcore.layers.gated_delta) for the
rule, and ``_prepare`` below, a copy of ``GatedDeltaNet.forward``'s per-sequence math (conv window
from the slot's conv state, ``F.conv1d``, SiLU, ``l2_normalize``, GQA repeat, g and beta) for the
decode step; one test also runs the layer itself. Everything is float32 (16-bit inputs are read
as float32 by both sides), so only the summation order (and, on CUDA, the approximate ``exp``)
differs: outputs and states must agree within 1e-5 absolute + 1e-5 relative in the interpreter
(observed <= 1e-6 at |values| <= ~1), 1e-4 on CUDA. The new conv state is a copy of inputs, so it
must be exact; slots the kernels must not touch are compared bit for bit.

On CPU the kernels run in the Triton interpreter on tiny shapes (Hk=2, Hv=4, Dk/Dv in {16, 32},
conv K=4, B=3); the CUDA section runs Qwen3.5-like shapes in bfloat16 and the decode step inside a
CUDA graph.
"""
from __future__ import annotations

import math

import pytest
import torch
from torch.nn import functional as F

pytest.importorskip("triton")

from vtcore.kernels.gated_delta import INTERPRET, chunk_gated_delta_rule, gdn_decode_step  # noqa: E402
from vtcore.layers.attention import AttentionMetadata, set_attention_metadata  # noqa: E402
from vtcore.layers.gated_delta import gated_delta_chunked, gated_delta_recurrent, l2_normalize  # noqa: E402
from vtcore.layers.gated_deltanet import GatedDeltaNet  # noqa: E402

interp = pytest.mark.skipif(not INTERPRET, reason="CPU tensors need the Triton interpreter")
cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
TOL = dict(atol=1e-5, rtol=1e-5)
CUDA_TOL = dict(atol=1e-4, rtol=1e-4)  # Dk = 128 sums and the GPU's approximate exp
KERNEL = 4


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


# ------------------------------------------------------------------------------------ references
class Weights:
    """A layer's conv and decay parameters: conv_weight [conv_dim, K], A_log and dt_bias [Hv]."""

    def __init__(self, hk: int, hv: int, dk: int, dv: int, seed: int, dtype: torch.dtype = torch.float32) -> None:
        g = _gen(seed)
        self.hk, self.hv, self.dk, self.dv = hk, hv, dk, dv
        self.conv_dim = 2 * hk * dk + hv * dv
        self.conv_weight = (torch.randn(self.conv_dim, KERNEL, generator=g) / KERNEL ** 0.5).to(dtype)
        self.A_log = torch.empty(hv).uniform_(0.05, 2.0, generator=g).log()
        self.A_log[0] = math.log(0.02)  # a slow head: softplus's linear branch (a = 25, see _tokens) shows in g
        self.dt_bias = torch.randn(hv, generator=g) * 0.5

    def args(self, device: str = "cpu") -> dict[str, torch.Tensor | int]:
        """gdn_decode_step's weight and size arguments."""
        return dict(conv_weight=self.conv_weight.to(device), A_log=self.A_log.to(device),
                    dt_bias=self.dt_bias.to(device), num_k_heads=self.hk, num_v_heads=self.hv, head_k_dim=self.dk,
                    head_v_dim=self.dv)


def _prepare(wt: Weights, mixed: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
             conv_state: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """GatedDeltaNet.forward's math for one sequence's tokens ``mixed`` [n, conv_dim], ``a``/``b``
    [n, Hv], from ``conv_state`` [conv_dim, K-1]: (q, k, v, g, beta, new conv state), q/k repeated
    to the value heads."""
    n = mixed.shape[0]
    window = torch.cat((conv_state, mixed.float().T), dim=-1)
    new_conv = window[:, window.shape[1] - (KERNEL - 1):]
    weight = wt.conv_weight.float()[:, None, :]
    qkv = F.silu(F.conv1d(window[None], weight, groups=wt.conv_dim)[0].T)
    q, k, v = qkv.split([wt.hk * wt.dk, wt.hk * wt.dk, wt.hv * wt.dv], dim=-1)
    q = l2_normalize(q.reshape(n, wt.hk, wt.dk)) * wt.dk ** -0.5
    k = l2_normalize(k.reshape(n, wt.hk, wt.dk))
    q, k = (x.repeat_interleave(wt.hv // wt.hk, dim=1) for x in (q, k))
    g = -wt.A_log.float().exp() * F.softplus(a.float() + wt.dt_bias.float())
    return q, k, v.reshape(n, wt.hv, wt.dv), g, b.float().sigmoid(), new_conv


def _sequence_ref(wt: Weights, mixed: torch.Tensor, a: torch.Tensor, b: torch.Tensor, conv_state: torch.Tensor,
                  rec_state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(out [n, Hv, Dv], conv state, recurrent state) of the layer's rule over a sequence, recurrent."""
    *rule_in, new_conv = _prepare(wt, mixed, a, b, conv_state)
    out, state = gated_delta_recurrent(*rule_in, rec_state)
    return out, new_conv, state


def _decode_ref(wt: Weights, mixed: torch.Tensor, a: torch.Tensor, b: torch.Tensor, conv_states: torch.Tensor,
                rec_states: torch.Tensor, slots: list[int], has_state: list[bool]) -> torch.Tensor:
    """One token per row, the states updated in place as the layer does; returns out [B, Hv, Dv]."""
    outs = []
    for row, (slot, keep) in enumerate(zip(slots, has_state)):
        conv = conv_states[slot] if keep else torch.zeros_like(conv_states[slot])
        rec = rec_states[slot] if keep else torch.zeros_like(rec_states[slot])
        out, conv_states[slot], rec_states[slot] = _sequence_ref(wt, mixed[row:row + 1], a[row:row + 1],
                                                                 b[row:row + 1], conv, rec)
        outs.append(out[0])
    return torch.stack(outs)


def _tokens(wt: Weights, n: int, seed: int,
            dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Projection outputs for n tokens: mixed [n, conv_dim], a, b [n, Hv]. Row 0's a has entries
    past softplus's linear threshold (+-25: decays exp(-50)-fast and ~1); b at +-12 makes beta ~0/1."""
    g = _gen(seed)
    mixed = torch.randn(n, wt.conv_dim, generator=g)
    a = torch.randn(n, wt.hv, generator=g) * 2
    b = torch.randn(n, wt.hv, generator=g) * 3
    a[0, :2] = torch.tensor([25.0, -25.0])
    b[-1, :2] = torch.tensor([12.0, -12.0])
    return mixed.to(dtype), a.to(dtype), b.to(dtype)


def _dirty_states(wt: Weights, num_slots: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = _gen(seed)
    conv = torch.randn(num_slots, wt.conv_dim, KERNEL - 1, generator=g)
    rec = torch.randn(num_slots, wt.hv, wt.dk, wt.dv, generator=g) * 0.5
    return conv, rec


def _rule_inputs(t: int, h: int, dk: int, dv: int, seed: int, g_range: tuple[float, float] = (-1.5, 0.0),
                 beta: torch.Tensor | None = None) -> tuple[torch.Tensor, ...]:
    """q, k l2-normalised (q scaled), v, g uniform in ``g_range``, beta in (0, 1), a state."""
    gen = _gen(seed)
    q = l2_normalize(torch.randn(t, h, dk, generator=gen)) * dk ** -0.5
    k = l2_normalize(torch.randn(t, h, dk, generator=gen))
    v = torch.randn(t, h, dv, generator=gen)
    g = torch.empty(t, h).uniform_(*g_range, generator=gen)
    beta = torch.rand(t, h, generator=gen) if beta is None else beta
    state = torch.randn(h, dk, dv, generator=gen) * 0.5
    return q, k, v, g, beta, state


# ------------------------------------------------------------------------------- decode (interpreter)
@interp
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("state_dtype", [torch.int32, torch.bool], ids=["int32", "bool"])
@pytest.mark.parametrize("dk,dv,block_dv", [(16, 32, None), (16, 32, 32), (32, 16, None)])
def test_decode_matches_layer_math(dk, dv, block_dv, state_dtype, dtype):
    """Rows in slots 5, 1, 3 of 7 (dirty states everywhere), the middle one without state: output,
    the written slots' conv and recurrent states; the other slots stay bit-identical."""
    wt = Weights(2, 4, dk, dv, seed=dk + dv, dtype=dtype)
    mixed, a, b = _tokens(wt, 3, seed=dk, dtype=dtype)
    conv, rec = _dirty_states(wt, 7, seed=dv)
    slots, keep = [5, 1, 3], [True, False, True]
    conv0, rec0 = conv.clone(), rec.clone()
    ref_conv, ref_rec = conv.clone(), rec.clone()
    ref = _decode_ref(wt, mixed, a, b, ref_conv, ref_rec, slots, keep)
    out = gdn_decode_step(mixed, a, b, conv_states=conv, rec_states=rec, slots=torch.tensor(slots),
                          has_state=torch.tensor(keep).to(state_dtype), **wt.args(), block_dv=block_dv)
    assert out.shape == (3, 4, dv) and out.dtype == torch.float32
    torch.testing.assert_close(out, ref, **TOL)
    torch.testing.assert_close(conv[slots], ref_conv[slots], rtol=0, atol=0)  # inputs copied: exact
    torch.testing.assert_close(rec[slots], ref_rec[slots], **TOL)
    untouched = [0, 2, 4, 6]
    assert torch.equal(conv[untouched], ref_conv[untouched]) and torch.equal(rec[untouched], ref_rec[untouched])
    # has_state really matters: the dirty state of slot 1 would change row 1
    assert (ref[1] - _decode_ref(wt, mixed, a, b, conv0, rec0, slots, [True] * 3)[1]).abs().max() > 1e-2


@interp
def test_decode_steps_continue_a_sequence():
    """Six decode steps (the first without state, the conv state rolling over twice) == the layer's
    recurrent rule over the six tokens; strided mixed_qkv rows (a view into a wider projection)."""
    wt = Weights(2, 4, 16, 16, seed=1)
    n = 6
    wide, a, b = _tokens(wt, n, seed=2)
    wide = torch.cat([wide, torch.randn(n, 8, generator=_gen(3))], dim=1)
    mixed = wide[:, :wt.conv_dim]
    conv, rec = _dirty_states(wt, 3, seed=4)
    outs = [gdn_decode_step(mixed[t:t + 1], a[t:t + 1], b[t:t + 1], conv_states=conv, rec_states=rec,
                            slots=torch.tensor([2]), has_state=torch.tensor([int(t > 0)], dtype=torch.int32),
                            **wt.args())
            for t in range(n)]
    ref_out, ref_conv, ref_rec = _sequence_ref(wt, mixed, a, b, torch.zeros_like(conv[0]), torch.zeros_like(rec[0]))
    torch.testing.assert_close(torch.cat(outs), ref_out, **TOL)
    torch.testing.assert_close(conv[2], ref_conv, rtol=0, atol=0)
    torch.testing.assert_close(rec[2], ref_rec, **TOL)


def _verify_ref(wt: Weights, mixed: torch.Tensor, a: torch.Tensor, b: torch.Tensor, conv_states: torch.Tensor,
                rec_states: torch.Tensor, slots: list[int], has_state: list[bool], out_slots: list[list[int]]
                ) -> torch.Tensor:
    """Rows of Q tokens: per row the rule over its tokens from its slot's state (or zeros), the state after
    token t written to out_slots[row][t] (-1: not written); returns out [B*Q, Hv, Dv]."""
    q = len(out_slots[0])
    outs, writes = [], []
    for row, (slot, keep, outs_of_row) in enumerate(zip(slots, has_state, out_slots)):
        conv = conv_states[slot] if keep else torch.zeros_like(conv_states[slot])
        rec = rec_states[slot] if keep else torch.zeros_like(rec_states[slot])
        rows = slice(row * q, row * q + q)
        outs.append(_sequence_ref(wt, mixed[rows], a[rows], b[rows], conv, rec)[0])
        for t, out_slot in enumerate(outs_of_row):
            if out_slot >= 0:
                end = slice(row * q, row * q + t + 1)
                writes.append((out_slot, _sequence_ref(wt, mixed[end], a[end], b[end], conv, rec)[1:]))
    for out_slot, (conv, rec) in writes:  # (after every read: a row's last write may be its own slot)
        conv_states[out_slot], rec_states[out_slot] = conv, rec
    return torch.cat(outs)


@interp
@pytest.mark.parametrize("q", [3, 5])
def test_verify_rows_write_the_state_after_each_token(q):
    """Rows of q tokens (a verify row's fed token and draft): row 0 full, from its state; row 1 without state,
    one padded token (no out slot); row 2 a padded row on slot 0 writing nothing. The state after each
    written token lands in its out slot (the last real one in the row's own slot), exactly as the rule over
    the tokens so far; the outputs are the rule's; every slot not written stays bit-identical."""
    wt = Weights(2, 4, 16, 32, seed=q)
    mixed, a, b = _tokens(wt, 3 * q, seed=q + 1)
    conv, rec = _dirty_states(wt, 12, seed=q + 2)
    slots, keep = [3, 5, 0], [True, False, True]
    out_slots = [[6 + t for t in range(q - 1)] + [3], [9 + t for t in range(q - 2)] + [5, -1], [-1] * q]
    ref_conv, ref_rec = conv.clone(), rec.clone()
    ref = _verify_ref(wt, mixed, a, b, ref_conv, ref_rec, slots, keep, out_slots)
    out = gdn_decode_step(mixed, a, b, conv_states=conv, rec_states=rec, slots=torch.tensor(slots),
                          has_state=torch.tensor(keep), out_slots=torch.tensor(out_slots), **wt.args())
    real = [t for t in range(3 * q) if t < 2 * q - 1]  # row 0's q tokens, row 1's q - 1
    torch.testing.assert_close(out[real], ref[real], **TOL)
    written = sorted(o for row in out_slots for o in row if o >= 0)
    torch.testing.assert_close(conv[written], ref_conv[written], rtol=0, atol=0)
    torch.testing.assert_close(rec[written], ref_rec[written], **TOL)
    untouched = [s for s in range(12) if s not in written]
    assert torch.equal(conv[untouched], ref_conv[untouched]) and torch.equal(rec[untouched], ref_rec[untouched])
    # the states after each token differ: a write to the wrong out slot would show
    assert (ref_rec[6] - ref_rec[7]).abs().max() > 1e-2


@interp
@pytest.mark.parametrize("t,chunk", [(5, 16), (64, 32), (130, 32)])
def test_prefill_then_decode(t, chunk):
    """Chunked prefill of t tokens (conv in torch, rule by the kernel) into a slot, then a decode
    step == the recurrent layer math over t + 1 tokens."""
    wt = Weights(2, 4, 16, 32, seed=t)
    mixed, a, b = _tokens(wt, t + 1, seed=t + 1)
    conv, rec = _dirty_states(wt, 2, seed=t + 2)
    *rule_in, conv_after = _prepare(wt, mixed[:t], a[:t], b[:t], torch.zeros_like(conv[0]))
    pre_out, pre_state = chunk_gated_delta_rule(*rule_in, torch.zeros_like(rec[0]), chunk=chunk)
    conv[1], rec[1] = conv_after, pre_state
    dec_out = gdn_decode_step(mixed[t:], a[t:], b[t:], conv_states=conv, rec_states=rec, slots=torch.tensor([1]),
                              has_state=torch.tensor([1], dtype=torch.int32), **wt.args())
    ref_out, ref_conv, ref_rec = _sequence_ref(wt, mixed, a, b, torch.zeros_like(conv[0]), torch.zeros_like(rec[0]))
    torch.testing.assert_close(pre_out, ref_out[:t], **TOL)
    torch.testing.assert_close(dec_out, ref_out[t:], **TOL)
    torch.testing.assert_close(conv[1], ref_conv, rtol=0, atol=0)
    torch.testing.assert_close(rec[1], ref_rec, **TOL)


@interp
def test_decode_matches_gated_deltanet_layer():
    """The layer itself (through its metadata) vs the kernel + the layer's gated norm and out_proj."""
    hidden, hk, hv, dk, dv = 32, 2, 4, 16, 16
    layer = GatedDeltaNet(hidden, hk, hv, dk, dv, KERNEL, 1e-6)
    g = _gen(7)
    with torch.no_grad():
        for p in layer.parameters():
            p.copy_(torch.randn(p.shape, generator=g) / math.sqrt(p.shape[-1]))
        layer.A_log.copy_(torch.empty(hv).uniform_(0.05, 2.0, generator=g).log())
    layer.allocate_state(5, torch.device("cpu"))
    conv, rec = layer.states["conv"], layer.states["recurrent"]
    conv.normal_(generator=g)
    rec.normal_(generator=g)
    conv0, rec0 = conv.clone(), rec.clone()
    x = torch.randn(3, hidden, generator=g)
    slots, keep = [3, 0, 2], [True, False, True]
    dummy = torch.zeros(1, 1, dtype=torch.int64)
    set_attention_metadata(AttentionMetadata(
        slot_mapping=torch.zeros(3, dtype=torch.int64), block_tables=dummy, context_lens=dummy[0],
        query_start_loc=dummy[0], max_query_len=1, max_context_len=1, seq_rows=[(0, 1), (1, 1), (2, 1)],
        state_slots=slots, has_state=keep))
    try:
        with torch.no_grad():
            want = layer(x)
    finally:
        set_attention_metadata(None)
    with torch.no_grad():
        mixed, z, b, a = layer.project(x)
        out = gdn_decode_step(mixed, a, b,
                              layer.conv1d.weight.view(layer.conv_dim, KERNEL), layer.A_log, layer.dt_bias, conv0,
                              rec0, torch.tensor(slots), torch.tensor(keep), hk, hv, dk, dv)
        y = layer.norm(out.reshape(-1, dv), z.reshape(-1, dv))
        got = layer.out_proj(y.reshape(3, hv * dv))
    torch.testing.assert_close(got, want, **TOL)
    torch.testing.assert_close(conv0, conv, rtol=0, atol=0)
    torch.testing.assert_close(rec0, rec, **TOL)


# ------------------------------------------------------------------------------ chunked (interpreter)
@interp
@pytest.mark.parametrize("t,chunk,block_dv", [(1, 16, None), (5, 16, None), (64, 16, 16), (64, 32, None),
                                              (130, 32, 16)])
def test_chunked_matches_references(t, chunk, block_dv):
    """Output and new state vs the recurrent and the torch chunked rule, from a non-zero state, for
    lengths of one token, under one chunk, exact chunks and a padded tail; Dv = 32 in one or two tiles.
    The input state is not modified."""
    q, k, v, g, beta, state = _rule_inputs(t, 4, 16, 32, seed=t + chunk)
    state0 = state.clone()
    out, new = chunk_gated_delta_rule(q, k, v, g, beta, state, chunk=chunk, block_dv=block_dv)
    assert out.shape == (t, 4, 32) and new.shape == (4, 16, 32) and out.dtype == new.dtype == torch.float32
    assert torch.equal(state, state0)
    for ref_out, ref_state in (gated_delta_recurrent(q, k, v, g, beta, state),
                               gated_delta_chunked(q, k, v, g, beta, state, chunk=chunk)):
        torch.testing.assert_close(out, ref_out, **TOL)
        torch.testing.assert_close(new, ref_state, **TOL)


@interp
def test_chunked_strided_and_16_bit_inputs():
    """v a view of a wider projection, g/beta transposed views, bf16 q/k/v (read as float32), Dk=32
    and Dv=16 (padded to the dot's 16): as the recurrent rule on the same values in float32."""
    q, k, v, g, beta, state = _rule_inputs(37, 2, 32, 16, seed=9)
    q, k = (x.to(torch.bfloat16) for x in (q, k))
    wide = torch.randn(37, 2, 24, generator=_gen(10)).to(torch.bfloat16)
    v = wide[:, :, 4:20]
    g_t, beta_t = g.T.contiguous(), beta.T.contiguous()
    out, new = chunk_gated_delta_rule(q, k, v, g_t.T, beta_t.T, state, chunk=16)
    ref_out, ref_state = gated_delta_recurrent(q.float(), k.float(), v.float(), g, beta, state)
    torch.testing.assert_close(out, ref_out, **TOL)
    torch.testing.assert_close(new, ref_state, **TOL)


@interp
@pytest.mark.parametrize("case", ["fast-decay", "beta-near-0-and-1", "beta-0"])
def test_chunked_extremes(case):
    """g in [-30, -5] (exp(cum) underflows within a chunk); beta at 1e-4 / 1 - 1e-4 alternating;
    beta = 0 (the state only decays: S exp(sum g), and padded-like tokens write nothing)."""
    t, h = 70, 2
    beta = None
    if case == "beta-near-0-and-1":
        beta = torch.tensor([1e-4, 1 - 1e-4]).repeat(t)[:t, None].expand(t, h).contiguous()
    elif case == "beta-0":
        beta = torch.zeros(t, h)
    q, k, v, g, beta, state = _rule_inputs(t, h, 16, 16, seed=11, beta=beta,
                                           g_range=(-30.0, -5.0) if case == "fast-decay" else (-0.3, 0.0))
    out, new = chunk_gated_delta_rule(q, k, v, g, beta, state, chunk=32)
    ref_out, ref_state = gated_delta_recurrent(q, k, v, g, beta, state)
    torch.testing.assert_close(out, ref_out, **TOL)
    torch.testing.assert_close(new, ref_state, **TOL)
    if case == "beta-0":
        torch.testing.assert_close(new, state * g.sum(0).exp()[:, None, None], **TOL)


# ------------------------------------------------------------------------------------- bad input
@interp
def test_bad_operands_are_named():
    wt = Weights(2, 4, 16, 16, seed=0)
    mixed, a, b = _tokens(wt, 2, seed=0)
    conv, rec = _dirty_states(wt, 3, seed=0)
    slots, keep = torch.tensor([0, 1]), torch.tensor([1, 1], dtype=torch.int32)
    args = dict(mixed_qkv=mixed, a=a, b=b, conv_states=conv, rec_states=rec, slots=slots, has_state=keep,
                **wt.args())
    bad = {
        "mixed_qkv": (mixed[:, :100], r"mixed_qkv \(2, 100\) float32 .*expected \[B, conv_dim=128\]"),
        "a": (a[:1], r"a \(1, 4\) .*expected \[B=2, Hv=4\]"),
        "conv_weight": (wt.conv_weight[:, None], r"conv_weight \(128, 1, 4\) .*expected \[conv_dim=128, K\]"),
        "rec_states": (rec.half(), r"rec_states \(3, 4, 16, 16\) float16 .*expected .* float32, contiguous"),
        "conv_states": (conv[:, :, :2], r"conv_states \(3, 128, 2\) .*expected \[num_slots, conv_dim=128, K-1=3\]"),
        "slots": (slots.int(), r"slots \(2,\) int32 .*expected \[B=2\] int64"),
        "has_state": (keep.float(), r"has_state \(2,\) float32 .*expected \[B=2\] int32/bool"),
        "out_slots": (torch.tensor([[0, 1, 2]]), r"out_slots \(1, 3\): expected \[B, Q\] with B\*Q = 2, the rows"),
    }
    for name, (value, message) in bad.items():
        with pytest.raises(ValueError, match=rf"gdn_decode_step: {message}"):
            gdn_decode_step(**{**args, name: value})
    with pytest.raises(ValueError, match=r"gdn_decode_step: slots \(2,\) int64 .*expected \[B=1\] int64"):
        gdn_decode_step(**args, out_slots=torch.tensor([[0, 1]]))  # one row of two tokens: one start slot
    with pytest.raises(ValueError, match="num_v_heads a multiple of num_k_heads"):
        gdn_decode_step(**{**args, "num_k_heads": 3})
    with pytest.raises(ValueError, match="gdn_decode_step: block_dv=24: expected a power of two >= 1"):
        gdn_decode_step(**args, block_dv=24)
    q, k, v, g, beta, state = _rule_inputs(5, 2, 16, 16, seed=0)
    with pytest.raises(ValueError, match=r"chunk_gated_delta_rule: k \(5, 2, 8\) .*expected \[T=5, H=2, Dk=16\]"):
        chunk_gated_delta_rule(q, k[..., :8], v, g, beta, state)
    with pytest.raises(ValueError, match=r"state \(2, 16, 8\) .*expected \[H=2, Dk=16, Dv=16\] float32"):
        chunk_gated_delta_rule(q, k, v, g, beta, state[..., :8])
    with pytest.raises(ValueError, match=r"g \(4, 2\) .*expected \[T=5, H=2\]"):
        chunk_gated_delta_rule(q, k, v, g[:4], beta, state)
    with pytest.raises(ValueError, match=r"v \(5, 2, 16\) float64"):
        chunk_gated_delta_rule(q, k, v.double(), g, beta, state)
    with pytest.raises(ValueError, match="chunk=24: expected a power of two >= 16"):
        chunk_gated_delta_rule(q, k, v, g, beta, state, chunk=24)


# ------------------------------------------------------------------------------------------ CUDA
# Qwen3.5-like linear-attention shapes: 16 key heads, 32 value heads, 128 x 128 per head. The
# references run on CPU (no TF32 in cuDNN's conv there).
HK, HV, DK, DV = 16, 32, 128, 128


@cuda
@pytest.mark.parametrize("batch", [1, 8, 33])
def test_cuda_decode_bf16(batch):
    wt = Weights(HK, HV, DK, DV, seed=batch, dtype=torch.bfloat16)
    mixed, a, b = _tokens(wt, batch, seed=batch, dtype=torch.bfloat16)
    conv, rec = _dirty_states(wt, batch + 3, seed=batch)
    slots = list(range(batch + 2, 1, -1))[:batch]
    keep = [i % 3 != 1 for i in range(batch)]
    ref_conv, ref_rec = conv.clone(), rec.clone()
    ref = _decode_ref(wt, mixed, a, b, ref_conv, ref_rec, slots, keep)
    conv, rec = conv.cuda(), rec.cuda()
    out = gdn_decode_step(mixed.cuda(), a.cuda(), b.cuda(), conv_states=conv, rec_states=rec,
                          slots=torch.tensor(slots, device="cuda"), has_state=torch.tensor(keep, device="cuda"),
                          **wt.args("cuda"))
    torch.testing.assert_close(out.cpu(), ref, **CUDA_TOL)
    torch.testing.assert_close(conv.cpu(), ref_conv, rtol=0, atol=0)
    torch.testing.assert_close(rec.cpu(), ref_rec, **CUDA_TOL)


@cuda
def test_cuda_verify_rows_bf16():
    """Verify rows of 4 tokens on Qwen3.5-like shapes: two full rows and one with a padded token."""
    wt = Weights(HK, HV, DK, DV, seed=4, dtype=torch.bfloat16)
    q = 4
    mixed, a, b = _tokens(wt, 3 * q, seed=4, dtype=torch.bfloat16)
    conv, rec = _dirty_states(wt, 16, seed=4)
    slots, keep = [1, 2, 3], [True, True, False]
    out_slots = [[4, 5, 6, 1], [7, 8, 9, 2], [10, 11, 3, -1]]
    ref_conv, ref_rec = conv.clone(), rec.clone()
    ref = _verify_ref(wt, mixed, a, b, ref_conv, ref_rec, slots, keep, out_slots)
    conv, rec = conv.cuda(), rec.cuda()
    out = gdn_decode_step(mixed.cuda(), a.cuda(), b.cuda(), conv_states=conv, rec_states=rec,
                          slots=torch.tensor(slots, device="cuda"), has_state=torch.tensor(keep, device="cuda"),
                          out_slots=torch.tensor(out_slots, device="cuda"), **wt.args("cuda"))
    torch.testing.assert_close(out[:-1].cpu(), ref[:-1], **CUDA_TOL)
    torch.testing.assert_close(conv.cpu(), ref_conv, rtol=0, atol=0)
    torch.testing.assert_close(rec.cpu(), ref_rec, **CUDA_TOL)


@cuda
@pytest.mark.parametrize("t", [1, 100, 300])
def test_cuda_chunked(t):
    inputs = _rule_inputs(t, 8, DK, DV, seed=t)
    out, new = chunk_gated_delta_rule(*(x.cuda() for x in inputs))
    ref_out, ref_state = gated_delta_recurrent(*inputs)
    torch.testing.assert_close(out.cpu(), ref_out, **CUDA_TOL)
    torch.testing.assert_close(new.cpu(), ref_state, **CUDA_TOL)


@cuda
def test_cuda_chunked_compiles_no_variant_per_length():
    """Once the chunked rule ran, prompts of other lengths (one token, one chunk, a multiple of 16 or
    not) compile nothing: a kernel specialised on the length stalled a step for a compile."""
    from vtcore.bench.step_stats import count_triton_compiles

    chunk_gated_delta_rule(*(x.cuda() for x in _rule_inputs(100, 4, DK, DV, seed=0)))  # 4 heads: no other test's
    with count_triton_compiles() as compiled:
        for t in (1, 16, 64, 77, 300):
            chunk_gated_delta_rule(*(x.cuda() for x in _rule_inputs(t, 4, DK, DV, seed=t)))
    assert compiled == []


@cuda
def test_cuda_graph_decode():
    """The decode step captured in a CUDA graph (padded row 3 on dummy slot 0), replayed on new
    tokens, slots and has_state written into the captured buffers."""
    wt = Weights(HK, HV, DK, DV, seed=1, dtype=torch.bfloat16)
    weights = wt.args("cuda")
    mixed, a, b = (x.cuda() for x in _tokens(wt, 4, seed=1, dtype=torch.bfloat16))
    conv, rec = (x.cuda() for x in _dirty_states(wt, 6, seed=1))
    slots = torch.tensor([1, 2, 3, 0], device="cuda")
    keep = torch.tensor([1, 1, 1, 1], dtype=torch.int32, device="cuda")

    def step() -> torch.Tensor:
        return gdn_decode_step(mixed, a, b, conv_states=conv, rec_states=rec, slots=slots, has_state=keep, **weights)

    step()  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step()
    new_tokens = _tokens(wt, 4, seed=2, dtype=torch.bfloat16)
    for dst, src in zip((mixed, a, b), new_tokens):
        dst.copy_(src)
    slots.copy_(torch.tensor([5, 2, 4, 0]))
    keep.copy_(torch.tensor([1, 0, 1, 1]))
    conv0, rec0 = _dirty_states(wt, 6, seed=3)
    conv.copy_(conv0)
    rec.copy_(rec0)
    graph.replay()
    torch.cuda.synchronize()
    ref_conv, ref_rec = conv0.clone(), rec0.clone()
    ref = _decode_ref(wt, *(x[:3] for x in new_tokens), ref_conv, ref_rec, [5, 2, 4], [True, False, True])
    torch.testing.assert_close(out[:3].cpu(), ref, **CUDA_TOL)
    torch.testing.assert_close(conv[1:].cpu(), ref_conv[1:], rtol=0, atol=0)  # slot 0: the padded row's
    torch.testing.assert_close(rec[1:].cpu(), ref_rec[1:], **CUDA_TOL)
    assert torch.equal(rec[1].cpu(), rec0[1]) and torch.equal(rec[3].cpu(), rec0[3])


@interp
def test_layer_prefill_calls_carry_the_state(monkeypatch):
    """``GatedDeltaNet._chunked_kernel`` (CUDA's prefill) in 64-token calls over 150 tokens from a
    nonzero state == the torch chunked rule over the whole sequence, output and state; slow decay
    (g in [-0.05, 0]) so the state carried between calls dominates (a dropped carry moves both)."""
    from types import SimpleNamespace

    from vtcore.layers import gated_deltanet

    monkeypatch.setattr(gated_deltanet, "KERNEL_MAX_TOKENS", 64)
    q, k, v, g, beta, state = _rule_inputs(150, 4, 16, 32, seed=21, g_range=(-0.05, 0.0))
    out, new_state = GatedDeltaNet._chunked_kernel(SimpleNamespace(chunk_size=32), q, k, v, g, beta, state)
    ref_out, ref_state = gated_delta_chunked(q, k, v, g, beta, state, chunk=32)
    torch.testing.assert_close(out, ref_out, **TOL)
    torch.testing.assert_close(new_state, ref_state, **TOL)
