"""A multi-token-prediction head run from scratch over one request's tokens: what its drafts must be."""
from __future__ import annotations

from typing import Sequence

import torch
from torch import nn

from vtcore.testing.layers import allocate_caches, sequence_step


def head_drafts_from_scratch(model: nn.Module, tokens: Sequence[int], k: int, block_size: int
                             ) -> list[tuple[int, float]]:
    """``model`` (with ``model.mtp``; its caches and states are replaced) over ``tokens[:-1]`` from fresh
    KV and state, the head over the same positions fed ``tokens[1:]``, then its chain of ``k - 1`` more:
    each draft token with its logit margin over the runner-up (a near-tie may go either way in a batch)."""
    n, device = len(tokens) - 1, next(model.parameters()).device
    blocks = range(-(-(n + k) // block_size))
    allocate_caches(model, len(blocks), block_size)
    ids = torch.tensor(list(tokens), device=device)
    out: list[tuple[int, float]] = []
    with torch.inference_mode():
        hidden = sequence_step(0, n, lambda pos: model(ids[:n], pos), blocks, device)
        h = sequence_step(0, n, lambda pos: model.mtp(ids[1:], pos, hidden), blocks, device)[-1:]
        for step in range(k):
            if step:
                last = torch.tensor([out[-1][0]], device=device)
                h = sequence_step(n - 1 + step, 1, lambda pos: model.mtp(last, pos, h, step), blocks,
                                  device)
            top = model.compute_logits(h)[0].float().topk(2)
            out.append((int(top.indices[0]), float(top.values[0] - top.values[1])))
    return out
