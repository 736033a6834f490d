"""Token bitmasks: a grammar's allowed tokens, 32 a word (bit j of word i: token 32 i + j), unpacked for the
sampler's logit edit, and the greedy draw under them in torch (the reference of
:mod:`vtcore.kernels.masked_argmax`). No Triton here: the sampler imports this module wherever it runs."""
from __future__ import annotations

import torch

__all__ = ["unpack_bitmask", "masked_argmax_ref"]


def unpack_bitmask(words: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """int32 words [rows, W] -> bool [rows, vocab_size]; ids past the words' 32 W tokens (a model vocabulary
    padded past its tokenizer's) are not allowed."""
    bits = torch.arange(32, device=words.device, dtype=torch.int32)
    allowed = ((words[:, :, None] >> bits) & 1).reshape(words.shape[0], 32 * words.shape[1])[:, :vocab_size].bool()
    if allowed.shape[1] < vocab_size:
        allowed = torch.cat([allowed, allowed.new_zeros(words.shape[0], vocab_size - allowed.shape[1])], dim=1)
    return allowed


def masked_argmax_ref(logits: torch.Tensor, words: torch.Tensor) -> torch.Tensor:
    """int64 [rows]: each row's argmax over the logits its mask allows (a row that allows nothing: 0)."""
    return logits.masked_fill(~unpack_bitmask(words, logits.shape[1]), float("-inf")).argmax(dim=-1)
