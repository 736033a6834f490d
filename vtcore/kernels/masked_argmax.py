"""The greedy draw of a step's constrained rows in one launch: each program scans its row's logits and
mask words (:mod:`vtcore.kernels.bitmask`) together and keeps the first largest allowed logit, which is
``torch.argmax``'s choice after every disallowed logit is set to -inf (:func:`masked_argmax_ref`), NaN
logits excepted (torch takes a NaN for the largest). Ids past the words' ``32 * W`` tokens are
disallowed; a row that allows nothing draws 0, as the reference does."""
from __future__ import annotations

from typing import Sequence

import torch
import triton
import triton.language as tl

from vtcore.kernels.bitmask import masked_argmax_ref

__all__ = ["masked_argmax", "masked_argmax_ref"]

_BLOCK = 4096  # logits a program reads at a time


@triton.jit(do_not_specialize=["vocab", "tokens", "stride_l", "stride_w"])  # (one variant for every shape)
def _masked_argmax_kernel(logits_ptr, words_ptr, out_ptr, into1_ptr, index1_ptr, into2_ptr, index2_ptr, vocab, tokens,
                          stride_l, stride_w, BLOCK: tl.constexpr, NUM_INTO: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    best = tl.full((), float("-inf"), tl.float32)
    best_id = tl.full((), 0, tl.int64)
    for start in range(0, vocab, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        x = tl.load(logits_ptr + row * stride_l + offs, mask=offs < vocab, other=float("-inf")).to(tl.float32)
        w = tl.load(words_ptr + row * stride_w + offs // 32, mask=offs < tokens, other=0)  # past them: none
        x = tl.where(((w >> (offs % 32)) & 1) != 0, x, float("-inf"))
        m = tl.max(x, axis=0)
        at = start + tl.argmax(x, axis=0, tie_break_left=True)
        better = m > best  # strictly: an equal later maximum keeps the first
        best_id = tl.where(better, at.to(tl.int64), best_id)
        best = tl.where(better, m, best)
    tl.store(out_ptr + row, best_id)
    if NUM_INTO >= 1:
        tl.store(into1_ptr + tl.load(index1_ptr + row), best_id.to(into1_ptr.dtype.element_ty))
    if NUM_INTO >= 2:
        tl.store(into2_ptr + tl.load(index2_ptr + row), best_id.to(into2_ptr.dtype.element_ty))


def masked_argmax(logits: torch.Tensor, words: torch.Tensor,
                  into: Sequence[tuple[torch.Tensor, torch.Tensor]] = ()) -> torch.Tensor:
    """int64 [rows]: each row's argmax over the logits its mask allows. ``logits`` [rows, V] (unit stride
    along V), ``words`` int32 [rows, W] on the same device. ``into``: at most two (target, index) pairs,
    contiguous 1-D integer targets and int64 [rows] indices: row r's token is also stored at
    ``target[index[r]]`` by the same launch (what ``target[index] = tokens`` would do, without its launches;
    the indices are the caller's to keep in bounds: the kernel does not check them)."""
    rows, vocab = logits.shape
    if words.shape[0] != rows or words.dtype != torch.int32:
        raise ValueError(f"words {tuple(words.shape)} {words.dtype}: expected int32 [{rows}, W] for logits "
                         f"{tuple(logits.shape)}")
    if logits.stride(1) != 1 or words.stride(1) != 1:
        raise ValueError(f"logits strides {logits.stride()}, words strides {words.stride()}: expected unit "
                         "strides along the vocabulary and the words")
    if len(into) > 2 or any(t.dim() != 1 or not t.is_contiguous() or i.shape != (rows,) or i.dtype != torch.int64
                            for t, i in into):
        raise ValueError(f"into {[(tuple(t.shape), tuple(i.shape), i.dtype) for t, i in into]}: expected at most "
                         f"two (contiguous 1-D target, int64 [{rows}] index) pairs")
    out = torch.empty(rows, dtype=torch.int64, device=logits.device)
    if rows:
        pointers = [p for pair in into for p in pair] + [out, out] * (2 - len(into))
        _masked_argmax_kernel[(rows,)](logits, words, out, *pointers, vocab, min(vocab, 32 * words.shape[1]),
                                       logits.stride(0), words.stride(0), BLOCK=_BLOCK, NUM_INTO=len(into))
    return out
