"""The gated delta rule (vtcore.layers.gated_delta) and the GatedDeltaNet layer's state handling.

The math: ``gated_delta_chunked`` == ``gated_delta_recurrent`` == an independent token-by-token,
head-by-head loop written here from the formula

    S_t = a_t S_{t-1} + k_t d_t^T,   d_t = b_t (v_t - a_t S_{t-1}^T k_t),   o_t = S_t^T q_t

(a_t = exp(g_t)), to ~1e-10 in float64 and ~1e-5 in float32: lengths below one chunk, exactly one,
not a multiple, several chunks; an initial state carried in; a state carried across calls. And
against transformers' own torch_chunk_gated_delta_rule / torch_recurrent_gated_delta_rule.

The layer: a small ``GatedDeltaNet`` driven directly through ``set_attention_metadata`` (only
``seq_rows``, ``state_slots`` and ``has_state`` matter to it): whole == chunked == token by token,
sequences in different slots don't interfere, ``has_state=False`` resets a dirty slot; and the
layer equals transformers' ``Qwen3_5GatedDeltaNet`` on the same weights.
"""
from __future__ import annotations

import math
from typing import Iterator

import pytest
import torch

from vtcore.layers.attention import AttentionMetadata, set_attention_metadata
from vtcore.layers.gated_delta import gated_delta_chunked, gated_delta_recurrent, l2_normalize
from vtcore.layers.gated_deltanet import GatedDeltaNet

F64 = dict(atol=1e-10, rtol=1e-10)
F32 = dict(atol=1e-5, rtol=1e-5)


# ---------------------------------------------------------------------------- the math
def reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
              state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The formula, one token and one head at a time (no batching over heads, no chunks)."""
    length, heads = q.shape[:2]
    states = [state[h].clone() for h in range(heads)]  # [Dk, Dv] each
    out = torch.empty(length, heads, v.shape[-1], dtype=v.dtype)
    for t in range(length):
        for h in range(heads):
            a = math.exp(float(g[t, h]))
            prev = states[h]
            d = float(beta[t, h]) * (v[t, h] - a * (prev.T @ k[t, h]))
            states[h] = a * prev + torch.outer(k[t, h], d)
            out[t, h] = states[h].T @ q[t, h]
    return out, torch.stack(states)


def rand_inputs(seed: int, length: int, heads: int, dk: int, dv: int, init_state: bool,
                dtype: torch.dtype = torch.float64) -> tuple[torch.Tensor, ...]:
    """q, k l2-normalised (q scaled by Dk^-0.5), log-decays g <= 0 (some near 0), beta in (0, 1)."""
    gen = torch.Generator().manual_seed(seed)

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen, dtype=torch.float64)

    q = l2_normalize(randn(length, heads, dk)) * dk ** -0.5
    k = l2_normalize(randn(length, heads, dk))
    v = randn(length, heads, dv)
    g = -torch.rand(length, heads, generator=gen, dtype=torch.float64) ** 2 * 1.5  # decay exp(g) in (0.22, 1]
    beta = torch.sigmoid(randn(length, heads) * 2)
    state = randn(heads, dk, dv) * 0.5 if init_state else torch.zeros(heads, dk, dv, dtype=torch.float64)
    return tuple(x.to(dtype) for x in (q, k, v, g, beta, state))


#: (length, heads, Dk, Dv, chunk)
SHAPES = [
    (1, 2, 4, 4, 8),  # a single token
    (5, 3, 8, 4, 8),  # shorter than one chunk
    (8, 2, 4, 8, 8),  # exactly one chunk
    (19, 2, 8, 8, 8),  # not a multiple of the chunk: 3 chunks, the last padded
    (45, 4, 16, 8, 16),  # several chunks
    (150, 2, 16, 16, 64),  # the default chunk, 3 chunks
]


@pytest.mark.parametrize("init_state", [False, True], ids=["zero-state", "initial-state"])
@pytest.mark.parametrize("shape", SHAPES, ids=[f"T{s[0]}-H{s[1]}-k{s[2]}-v{s[3]}-c{s[4]}" for s in SHAPES])
def test_chunked_recurrent_and_reference_agree_float64(shape: tuple[int, ...], init_state: bool) -> None:
    length, heads, dk, dv, chunk = shape
    seed = 1000 * SHAPES.index(shape) + init_state
    q, k, v, g, beta, state = rand_inputs(seed, length, heads, dk, dv, init_state)
    inputs = [x.clone() for x in (q, k, v, g, beta, state)]
    ref_out, ref_state = reference(q, k, v, g, beta, state)
    rec_out, rec_state = gated_delta_recurrent(q, k, v, g, beta, state)
    chk_out, chk_state = gated_delta_chunked(q, k, v, g, beta, state, chunk=chunk)
    assert chk_out.dtype == rec_out.dtype == torch.float64
    assert chk_out.shape == (length, heads, dv) and chk_state.shape == (heads, dk, dv)
    torch.testing.assert_close(rec_out, ref_out, **F64)
    torch.testing.assert_close(rec_state, ref_state, **F64)
    torch.testing.assert_close(chk_out, ref_out, **F64)
    torch.testing.assert_close(chk_state, ref_state, **F64)
    for before, after in zip(inputs, (q, k, v, g, beta, state)):
        assert torch.equal(before, after), "the rule must not modify its inputs (the initial state included)"
    if init_state:  # the initial state really matters to the result
        zero_out, _ = gated_delta_chunked(q, k, v, g, beta, torch.zeros_like(state), chunk=chunk)
        assert (zero_out - ref_out).abs().max() > 1e-3


@pytest.mark.parametrize("shape", SHAPES[1:], ids=[f"T{s[0]}-c{s[4]}" for s in SHAPES[1:]])
def test_chunked_and_recurrent_float32(shape: tuple[int, ...]) -> None:
    length, heads, dk, dv, chunk = shape
    inputs64 = rand_inputs(77 + length, length, heads, dk, dv, init_state=True)
    ref_out, ref_state = reference(*inputs64)
    inputs32 = [x.float() for x in inputs64]
    for out, state in (gated_delta_recurrent(*inputs32), gated_delta_chunked(*inputs32, chunk=chunk)):
        assert out.dtype == state.dtype == torch.float32
        torch.testing.assert_close(out, ref_out.float(), **F32)
        torch.testing.assert_close(state, ref_state.float(), **F32)


@pytest.mark.parametrize("pieces", [(7, 1, 37), (16, 16, 13), (1, 1, 43), (30, 14, 1)])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_state_carried_across_calls(pieces: tuple[int, int, int], dtype: torch.dtype) -> None:
    """A sequence in 3 pieces, passing the state along (chunked, or recurrent for 1 token) == one call."""
    q, k, v, g, beta, state = rand_inputs(sum(pieces) * 31 + pieces[0], sum(pieces), 3, 8, 8, True, dtype)
    tol = F64 if dtype == torch.float64 else F32
    whole_out, whole_state = gated_delta_chunked(q, k, v, g, beta, state, chunk=16)
    for rule in ("chunked", "recurrent", "mixed"):
        outs, s, row = [], state, 0
        for n in pieces:
            part = [x[row:row + n] for x in (q, k, v, g, beta)]
            if rule == "recurrent" or (rule == "mixed" and n == 1):
                o, s = gated_delta_recurrent(*part, s)
            else:
                o, s = gated_delta_chunked(*part, s, chunk=16)
            outs.append(o)
            row += n
        torch.testing.assert_close(torch.cat(outs), whole_out, **tol, msg=lambda m: f"{rule}: {m}")
        torch.testing.assert_close(s, whole_state, **tol, msg=lambda m: f"{rule}: {m}")


def test_decay_and_write_strength_extremes() -> None:
    """beta = 0 leaves the state only decayed; g = 0 and beta = 1 store v exactly along a unit k."""
    q, k, v, g, beta, state = rand_inputs(5, 20, 2, 8, 4, True)
    out, new = gated_delta_chunked(q, k, v, g, torch.zeros_like(beta), state, chunk=8)
    torch.testing.assert_close(new, state * g.sum(0).exp()[:, None, None], **F64)
    k1 = l2_normalize(torch.randn(1, 1, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(1)), 0.0)
    v1 = torch.arange(4, dtype=torch.float64).view(1, 1, 4)
    _, s1 = gated_delta_chunked(k1, k1, v1, torch.zeros(1, 1, dtype=torch.float64),
                                torch.ones(1, 1, dtype=torch.float64), state[:1], chunk=8)
    torch.testing.assert_close(s1[0].T @ k1[0, 0], v1[0, 0], **F64)  # the delta rule overwrote k1's value


# ---------------------------------------------------------------------------- transformers' rules
def _hf_rules():
    from transformers.models.qwen3_5 import modeling_qwen3_5 as hf

    return hf.torch_chunk_gated_delta_rule, hf.torch_recurrent_gated_delta_rule


@pytest.mark.parametrize("l2_in_kernel", [True, False], ids=["hf-normalises", "pre-normalised"])
@pytest.mark.parametrize("length,hk,hv,chunk", [(1, 2, 4, 8), (13, 2, 2, 8), (37, 2, 4, 16), (70, 1, 3, 64)])
def test_matches_transformers_rules(length: int, hk: int, hv: int, chunk: int, l2_in_kernel: bool) -> None:
    """HF takes raw (or just normalised) q/k with k heads and scales q itself; vtcore takes q/k
    normalised, q scaled by Dk^-0.5 and repeated to the value heads (as GatedDeltaNet does)."""
    hf_chunk, hf_recurrent = _hf_rules()
    dk, dv = 8, 16
    gen = torch.Generator().manual_seed(length * 10 + hv)
    q_raw, k_raw = (torch.randn(length, hk, dk, generator=gen) * 3 for _ in range(2))
    v = torch.randn(length, hv, dv, generator=gen)
    g = -torch.rand(length, hv, generator=gen) * 1.2
    beta = torch.rand(length, hv, generator=gen)
    state = torch.randn(hv, dk, dv, generator=gen) * 0.3
    q, k = l2_normalize(q_raw) * dk ** -0.5, l2_normalize(k_raw)
    q, k = (x.repeat_interleave(hv // hk, dim=1) for x in (q, k))
    ours_rec = gated_delta_recurrent(q, k, v, g, beta, state)
    ours_chk = gated_delta_chunked(q, k, v, g, beta, state, chunk=chunk)
    hq, hk_ = (q_raw, k_raw) if l2_in_kernel else (l2_normalize(q_raw), l2_normalize(k_raw))
    common = dict(g=g[None], beta=beta[None], initial_state=state[None], output_final_state=True,
                  use_qk_l2norm_in_kernel=l2_in_kernel)
    theirs_chk = hf_chunk(hq[None], hk_[None], v[None], chunk_size=chunk, **common)
    theirs_rec = hf_recurrent(hq[None], hk_[None], v[None], **common)
    for (out, st), name in ((ours_rec, "recurrent"), (ours_chk, "chunked")):
        for (hout, hst), hname in ((theirs_rec, "HF recurrent"), (theirs_chk, "HF chunked")):
            torch.testing.assert_close(out, hout[0], **F32, msg=lambda m: f"{name} vs {hname} output: {m}")
            torch.testing.assert_close(st, hst[0], **F32, msg=lambda m: f"{name} vs {hname} state: {m}")


# ---------------------------------------------------------------------------- the layer
HIDDEN, HK, HV, DK, DV, KERNEL = 32, 2, 4, 8, 8, 4


@pytest.fixture(autouse=True)
def _no_metadata_left() -> Iterator[None]:
    yield
    set_attention_metadata(None)


@torch.no_grad()
def make_gdn(seed: int, hk: int = HK, hv: int = HV, num_slots: int = 4) -> GatedDeltaNet:
    layer = GatedDeltaNet(HIDDEN, hk, hv, DK, DV, KERNEL, 1e-6)
    gen = torch.Generator().manual_seed(seed)
    for p in layer.parameters():
        p.copy_(torch.randn(p.shape, generator=gen) / math.sqrt(p.shape[-1]))
    layer.A_log.copy_(torch.empty(hv).uniform_(0.05, 2.0, generator=gen).log())  # decays that remember
    layer.dt_bias.copy_(torch.randn(hv, generator=gen) * 0.5)
    layer.norm.weight.copy_(1.0 + torch.randn(DV, generator=gen) * 0.2)
    layer.allocate_state(num_slots, torch.device("cpu"))
    assert set(layer.states) == {"conv", "recurrent"}
    assert layer.states["conv"].shape == (num_slots, 2 * hk * DK + hv * DV, KERNEL - 1)
    assert layer.states["recurrent"].shape == (num_slots, hv, DK, DV)
    return layer


def set_seqs(seqs: list[tuple[int, int, bool]]) -> None:
    """Metadata for sequences of (token count, state slot, has_state), laid out one after another.
    The paged-attention fields are dummies: GatedDeltaNet reads only the host lists."""
    rows, row = [], 0
    for n, _, _ in seqs:
        rows.append((row, n))
        row += n
    dummy = torch.zeros(1, 1, dtype=torch.int64)
    set_attention_metadata(AttentionMetadata(
        slot_mapping=torch.zeros(row, dtype=torch.int64), block_tables=dummy, context_lens=dummy[0],
        query_start_loc=dummy[0], max_query_len=1, max_context_len=1, seq_rows=rows,
        state_slots=[s for _, s, _ in seqs], has_state=[h for _, _, h in seqs]))


@torch.no_grad()
def run(layer: GatedDeltaNet, x: torch.Tensor, pieces: list[int], slot: int = 0) -> torch.Tensor:
    """Feed ``x`` [T, hidden] to ``layer`` in ``pieces`` (has_state after the first), one slot."""
    outs, row = [], 0
    for i, n in enumerate(pieces):
        set_seqs([(n, slot, i > 0)])
        outs.append(layer(x[row:row + n]))
        row += n
    assert row == x.shape[0]
    return torch.cat(outs)


def states_of(layer: GatedDeltaNet, slot: int) -> tuple[torch.Tensor, torch.Tensor]:
    return layer.states["conv"][slot].clone(), layer.states["recurrent"][slot].clone()


def rand_x(seed: int, n: int) -> torch.Tensor:
    return torch.randn(n, HIDDEN, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("chunk_size", [8, 64])
@pytest.mark.parametrize("hv", [2, 4], ids=["v-eq-k", "v-2x-k"])
def test_layer_whole_chunked_and_token_by_token_agree(chunk_size: int, hv: int) -> None:
    x = rand_x(3, 21)
    outputs, states = {}, {}
    for name, pieces in {"whole": [21], "chunks": [5, 1, 2, 9, 4], "tokens": [1] * 21,
                         "two": [20, 1]}.items():
        layer = make_gdn(seed=11, hv=hv)
        layer.chunk_size = chunk_size
        outputs[name] = run(layer, x, pieces, slot=2)
        states[name] = states_of(layer, 2)
        for other in (0, 1, 3):
            assert not layer.states["conv"][other].any() and not layer.states["recurrent"][other].any()
    assert outputs["whole"].shape == (21, HIDDEN) and outputs["whole"].abs().max() > 1e-3
    for name in ("chunks", "tokens", "two"):
        torch.testing.assert_close(outputs[name], outputs["whole"], **F32, msg=lambda m: f"{name}: {m}")
        for got, want in zip(states[name], states["whole"]):
            torch.testing.assert_close(got, want, **F32, msg=lambda m: f"{name} state: {m}")
    # the conv state is the last K-1 pre-conv inputs
    layer = make_gdn(seed=11, hv=hv)
    mixed = layer.project(x)[0][-(KERNEL - 1):].T
    torch.testing.assert_close(states["whole"][0], mixed, **F32)


def test_sequences_in_different_slots_do_not_interfere() -> None:
    a, b = rand_x(21, 12), rand_x(22, 9)
    alone_a = run(make_gdn(seed=5), a, [11, 1])  # a prefill chunk, then a decode token
    alone_b = run(make_gdn(seed=5), b, [5, 4])
    layer = make_gdn(seed=5)
    layer.chunk_size = 4
    with torch.no_grad():
        set_seqs([(11, 3, False), (5, 1, False)])
        first = layer(torch.cat([a[:11], b[:5]]))
        set_seqs([(4, 1, True), (1, 3, True)])  # the other order, B's chunk beside A's decode
        second = layer(torch.cat([b[5:], a[11:]]))
    torch.testing.assert_close(first[:11], alone_a[:11], **F32)
    torch.testing.assert_close(first[11:], alone_b[:5], **F32)
    torch.testing.assert_close(second[:4], alone_b[5:], **F32)
    torch.testing.assert_close(second[4:], alone_a[11:], **F32)
    for unused in (0, 2):
        assert not layer.states["conv"][unused].any() and not layer.states["recurrent"][unused].any()


@pytest.mark.parametrize("n", [1, 2, 7], ids=lambda n: f"len{n}")
def test_has_state_false_resets_a_dirty_slot(n: int) -> None:
    """A new request in a reused slot starts from zero conv and recurrent state, however short it is."""
    y = rand_x(40 + n, n)
    fresh = run(make_gdn(seed=9), y, [n], slot=1)
    layer = make_gdn(seed=9)
    run(layer, rand_x(99, 13), [13], slot=1)  # the slot's previous owner
    with torch.no_grad():
        layer.states["conv"][1].normal_()
        layer.states["recurrent"][1].normal_()  # and some garbage for good measure
    dirty = run(layer, y, [n], slot=1)
    torch.testing.assert_close(dirty, fresh, **F32)
    # while has_state=True on the same dirty slot does read it
    with torch.no_grad():
        layer.states["recurrent"][1].normal_()
        set_seqs([(n, 1, True)])
        assert not torch.allclose(layer(y), fresh, **F32)


@pytest.mark.parametrize("hk,hv", [(2, 2), (2, 4)])
def test_layer_matches_transformers_gated_deltanet(hk: int, hv: int) -> None:
    """The whole layer (projections, conv, rule, gated norm, out_proj) against HF's module, same weights."""
    import transformers
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5GatedDeltaNet

    config = transformers.Qwen3_5TextConfig(
        hidden_size=HIDDEN, linear_num_key_heads=hk, linear_num_value_heads=hv, linear_key_head_dim=DK,
        linear_value_head_dim=DV, linear_conv_kernel_dim=KERNEL, rms_norm_eps=1e-6, num_hidden_layers=1,
        layer_types=["linear_attention"], num_attention_heads=2, num_key_value_heads=1, head_dim=16)
    hf = Qwen3_5GatedDeltaNet(config, 0).float().eval()
    ours = make_gdn(seed=13, hk=hk, hv=hv)
    ours.chunk_size = 8
    state = dict(ours.state_dict())  # our fused input projections, split back into HF's four
    for fused in ("in_proj_qkvz", "in_proj_ba"):
        weight = state.pop(f"{fused}.weight")
        for shard, rows in getattr(ours, fused).shard_slices.items():
            state[f"in_proj_{shard}.weight"] = weight[rows]
    missing, unexpected = hf.load_state_dict(state, strict=True)
    assert not missing and not unexpected
    x = rand_x(14, 19)
    with torch.no_grad():
        want = hf(x[None])[0]
    got = run(ours, x, [19])
    torch.testing.assert_close(got, want, **F32)
    torch.testing.assert_close(run(make_gdn(seed=13, hk=hk, hv=hv), x, [6, 1, 12]), want, **F32)
