"""Running a model's layers outside the runner, for layer tests: one sequence's step with its metadata set."""
from __future__ import annotations

from typing import Callable, Sequence, TypeVar

import torch

from vtcore.layers.attention import Attention, AttentionMetadata, set_attention_metadata
from vtcore.layers.state import StatefulLayer

T = TypeVar("T")


def allocate_caches(model: torch.nn.Module, num_blocks: int, block_size: int) -> None:
    """Fresh, zeroed KV caches of ``num_blocks`` blocks for every attention layer of ``model``, and one state
    slot for every stateful layer (what :func:`sequence_step` addresses)."""
    param = next(model.parameters())
    for m in model.modules():
        if isinstance(m, Attention):
            m.k_cache, m.v_cache = (torch.zeros(num_blocks * block_size, m.num_kv_heads, m.head_dim, dtype=param.dtype,
                                                device=param.device) for _ in range(2))
            m.block_size = block_size
        elif isinstance(m, StatefulLayer):
            m.allocate_state(1, param.device)


def sequence_step(start: int, n: int, run: Callable[[torch.Tensor], T], blocks: Sequence[int] = (0, 1),
                  device: torch.device | str = "cpu") -> T:
    """``run(positions)`` as one step of tokens ``start .. start + n - 1`` of one sequence whose KV
    lives in cache slots ``0 ..`` of the layers' caches (block table ``blocks``, in order); stateful
    layers keep its state in slot 0 (starting from zero at position 0)."""
    set_attention_metadata(AttentionMetadata(
        slot_mapping=torch.arange(start, start + n, device=device),
        block_tables=torch.tensor([list(blocks)], device=device),
        context_lens=torch.tensor([start + n], device=device),
        query_start_loc=torch.tensor([0, n], device=device), max_query_len=n,
        max_context_len=start + n, seq_rows=[(0, n)], state_slots=[0], has_state=[start > 0]))
    try:
        return run(torch.arange(start, start + n, device=device))
    finally:
        set_attention_metadata(None)
