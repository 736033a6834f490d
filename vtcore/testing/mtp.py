"""A multi-token-prediction head run from scratch over one request's tokens: what its drafts must be."""
from __future__ import annotations

from typing import Sequence

import torch
from torch import nn

from vtcore.layers.attention import Attention
from vtcore.layers.state import StatefulLayer
from vtcore.testing.layers import sequence_step


def head_drafts_from_scratch(model: nn.Module, tokens: Sequence[int], k: int, block_size: int
                             ) -> list[tuple[int, float]]:
    """``model`` (with ``model.mtp``; its caches and states are replaced) over ``tokens[:-1]`` from fresh
    KV and state, the head over the same positions fed ``tokens[1:]``, then its chain of ``k - 1`` more:
    each draft token with its logit margin over the runner-up (a near-tie may go either way in a batch)."""
    n, device = len(tokens) - 1, next(model.parameters()).device
    blocks = range(-(-(n + k) // block_size))
    for m in model.modules():
        if isinstance(m, Attention):
            m.k_cache, m.v_cache = (torch.zeros(len(blocks) * block_size, m.num_kv_heads, m.head_dim,
                                                dtype=next(model.parameters()).dtype, device=device) for _ in range(2))
            m.block_size = block_size
        elif isinstance(m, StatefulLayer):
            m.allocate_state(1, device)
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
