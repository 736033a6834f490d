"""The greedy draw under token bitmasks: the one-launch kernel against the torch reference (unpack, mask,
argmax), and the sampler's CUDA path that takes it."""
from __future__ import annotations

import os

import pytest
import torch

from vtcore.kernels.bitmask import masked_argmax_ref, unpack_bitmask

device = "cuda" if torch.cuda.is_available() else "cpu"
runs = pytest.mark.skipif(device == "cpu" and os.environ.get("TRITON_INTERPRET") != "1",
                          reason="CPU tensors need the Triton interpreter")


def _pack(allowed: torch.Tensor) -> torch.Tensor:
    """bool [rows, 32 W] -> int32 words [rows, W] (bit j of word i: token 32 i + j)."""
    bits = allowed.view(allowed.shape[0], -1, 32).long() << torch.arange(32)
    return bits.sum(-1).to(torch.int64).apply_(lambda v: v - (1 << 32) if v >= 1 << 31 else v).to(torch.int32)


def test_unpack_disallows_the_ids_past_the_words():
    allowed = torch.zeros(2, 64, dtype=torch.bool)
    allowed[0, [0, 31, 63]] = True  # bit 31: the word's sign bit
    got = unpack_bitmask(_pack(allowed), 100)
    assert got.shape == (2, 100) and torch.equal(got[:, :64], allowed) and not got[:, 64:].any()


@runs
def test_masked_argmax_matches_the_reference():
    from vtcore.kernels.masked_argmax import masked_argmax

    g = torch.Generator().manual_seed(0)
    rows, tokens, vocab = 6, 8992, 9000  # three 4096-wide blocks; ids 8992.. are padding past the words
    logits = torch.randn(rows, vocab, generator=g)
    allowed = torch.rand(rows, tokens, generator=g) < 0.3
    allowed[1] = False  # allows nothing: 0, as the reference's argmax over -inf
    allowed[2] = False
    allowed[2, [5000, 8191, 8400]] = True  # a later block's best
    logits[2, [5000, 8400]] = 50.0  # a tie across blocks: the first
    allowed[3] = False
    allowed[3, [31, 63]] = True  # sign bits
    logits[:, tokens:] = 100.0  # padding ids: never drawn
    logits[4, :tokens][~allowed[4]] = 80.0  # every disallowed logit above the allowed ones
    words = _pack(allowed)
    want = masked_argmax_ref(logits, words)
    got = masked_argmax(logits.to(device), words.to(device)).cpu()
    assert torch.equal(got, want)
    assert got[1] == 0 and got[2] == 5000 and got[3] in (31, 63) and bool(allowed[4, got[4]])
    with pytest.raises(ValueError, match="expected int32"):
        masked_argmax(logits.to(device), words[:2].to(device))
    with pytest.raises(ValueError, match="unit strides"):
        masked_argmax(logits.t().contiguous().t().to(device), words.to(device))
    assert masked_argmax(logits[:0].to(device), words[:0].to(device)).shape == (0,)


@runs
def test_masked_argmax_also_writes_its_tokens_where_it_is_told():
    """``into``: the same launch stores row r's token at ``target[index[r]]`` (the step's mirror and its
    token row), as ``target[index] = tokens`` would; other entries keep their values."""
    from vtcore.kernels.masked_argmax import masked_argmax

    g = torch.Generator().manual_seed(2)
    logits = torch.randn(3, 300, generator=g).to(device)
    words = _pack(torch.rand(3, 288, generator=g) < 0.2).to(device)
    mirror = torch.full((10,), -7, dtype=torch.int64, device=device)
    row_tokens = torch.full((5,), -9, dtype=torch.int64, device=device)
    at_mirror, at_rows = torch.tensor([8, 2, 5], device=device), torch.tensor([4, 0, 1], device=device)
    got = masked_argmax(logits, words, into=[(mirror, at_mirror), (row_tokens, at_rows)])
    want_mirror = torch.full((10,), -7, dtype=torch.int64)
    want_mirror[[8, 2, 5]] = got.cpu()
    assert torch.equal(got.cpu(), masked_argmax_ref(logits.cpu(), words.cpu()))
    assert torch.equal(mirror.cpu(), want_mirror)
    assert row_tokens.cpu().tolist() == [got[1].item(), got[2].item(), -9, -9, got[0].item()]
    with pytest.raises(ValueError, match="at most two"):
        masked_argmax(logits, words, into=[(mirror, at_mirror.int())])


def test_the_general_sampler_path_writes_into_its_targets_too():
    from vtcore.worker.sampler import Sampler, SamplingBatch

    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(3))
    batch = SamplingBatch(metas=[], greedy=True, temperature=None, top_k=None, top_p=None, min_p=None,
                          random_rows=None, random_list=[], edits=[], max_logprobs=None)
    target = torch.zeros(6, dtype=torch.int64)
    tokens = Sampler(50, torch.device("cpu"), [0], seed=0).sample(logits, batch, logits.new_zeros(3),
                                                                   into=[(target, torch.tensor([5, 0, 3]))])["tokens"]
    assert torch.equal(tokens, logits.argmax(-1)) and target.tolist() == [tokens[1], 0, 0, tokens[2], 0, tokens[0]]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_the_cuda_sampler_draws_greedy_masked_rows_as_the_general_path_does(monkeypatch):
    """A batch whose every row is greedy and held to a mask (a late draw's) takes the one-launch draw; a
    batch with one row unmasked takes the general path; both give the reference's tokens."""
    from vtcore.kernels import masked_argmax as kernel
    from vtcore.worker.sampler import Sampler, SamplingBatch

    launches = []
    original = kernel.masked_argmax
    monkeypatch.setattr(kernel, "masked_argmax", lambda *a: (launches.append(1), original(*a))[1])

    g = torch.Generator().manual_seed(1)
    logits = torch.randn(4, 5000, generator=g).cuda()
    allowed = torch.rand(4, 4992, generator=g) < 0.1
    words = _pack(allowed).cuda()
    sampler = Sampler(5000, torch.device("cuda"), [0], seed=0)

    def batch(rows: list[int]) -> SamplingBatch:
        return SamplingBatch(metas=[], greedy=True, temperature=None, top_k=None, top_p=None, min_p=None,
                             random_rows=None, random_list=[], edits=[], max_logprobs=None,
                             masked_rows=torch.tensor(rows, device="cuda"), bitmasks=words[rows])

    want = masked_argmax_ref(logits.cpu(), words.cpu())
    assert torch.equal(sampler.sample(logits, batch([0, 1, 2, 3]), logits.new_zeros(4))["tokens"].cpu(), want)
    assert launches == [1]
    some = sampler.sample(logits, batch([0, 2]), logits.new_zeros(4))["tokens"].cpu()
    assert torch.equal(some[[0, 2]], want[[0, 2]]) and torch.equal(some[[1, 3]], logits[[1, 3]].argmax(-1).cpu())
    assert launches == [1]  # the general path for a batch with unmasked rows
    mirror = torch.zeros(9, dtype=torch.int64, device="cuda")
    at = torch.tensor([7, 1, 3, 0], device="cuda")
    tokens = sampler.sample(logits, batch([0, 1, 2, 3]), logits.new_zeros(4), into=[(mirror, at)])["tokens"]
    assert launches == [1, 1] and torch.equal(tokens.cpu(), want)
    assert mirror.cpu().tolist() == [want[3], want[1], 0, want[2], 0, 0, 0, want[0], 0]  # written by the launch
