"""Paged attention in torch: new K/V go into a block-paged cache, queries attend over it.

The runner sets one ``AttentionMetadata`` per forward (``set_attention_metadata``); every
attention layer of the model reads it. The cache of a layer is ``[num_blocks * block_size,
kv_heads, head_dim]`` for K and for V, indexed by slot (``block * block_size + offset``).
"""
from __future__ import annotations

import threading

import attrs
import torch
from torch import nn
from torch.nn import functional as F


@attrs.define
class AttentionMetadata:
    """Where this step's tokens go and what each query may see.

    ``slot_mapping`` [tokens]: the cache slot each new token's K/V is written to.
    ``key_slots`` [seqs, max_context]: the slots of each sequence's context, in position order.
    ``query_index`` [seqs, max_query]: the token row of each sequence's i-th query (padding: 0).
    ``query_positions`` [seqs, max_query]: the absolute position of that query (padding: 0).
    ``query_valid`` [seqs, max_query]: which entries of the padded layout are real tokens.
    ``token_index`` [tokens]: where each token sits in the flattened padded layout (gathering by
    index, unlike boolean masking, needs no device-to-host sync).
    Host lists, for stateful (linear-attention) layers: ``seq_rows`` (first row, token count) per
    sequence, ``state_slots`` (its state slot) and ``has_state`` (False when its first scheduled
    token is position 0, so its state starts from zero).
    """

    slot_mapping: torch.Tensor
    key_slots: torch.Tensor
    query_index: torch.Tensor
    query_positions: torch.Tensor
    query_valid: torch.Tensor
    token_index: torch.Tensor
    seq_rows: list[tuple[int, int]] = attrs.Factory(list)
    state_slots: list[int] = attrs.Factory(list)
    has_state: list[bool] = attrs.Factory(list)
    attn_mask: torch.Tensor = attrs.field(init=False)

    def __attrs_post_init__(self) -> None:
        # [seqs, 1, max_query, max_context]: causal over the context; padding rows see key 0
        # (a row that sees nothing would be NaN), and their outputs are dropped anyway.
        keys = torch.arange(self.key_slots.shape[1], device=self.key_slots.device)
        allowed = (keys[None, None, :] <= self.query_positions[:, :, None]) & self.query_valid[:, :, None]
        self.attn_mask = (allowed | (keys == 0)[None, None, :]).unsqueeze(1)


# Per thread: an async engine runs its forwards on a worker thread, and several engines may live
# in one process.
_local = threading.local()


def set_attention_metadata(metadata: AttentionMetadata | None) -> None:
    _local.metadata = metadata


def get_attention_metadata() -> AttentionMetadata:
    metadata = getattr(_local, "metadata", None)
    if metadata is None:
        raise RuntimeError("attention ran outside a runner step: no AttentionMetadata is set")
    return metadata


class Attention(nn.Module):
    """Scaled dot-product attention over a paged KV cache, GQA included."""

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float) -> None:
        super().__init__()
        if num_heads % num_kv_heads:
            raise ValueError(f"num_attention_heads={num_heads} is not a multiple of num_key_value_heads={num_kv_heads}")
        self.num_heads, self.num_kv_heads, self.head_dim, self.scale = num_heads, num_kv_heads, head_dim, scale
        self.k_cache = self.v_cache = torch.empty(0)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """``q`` [tokens, heads, dim], ``k``/``v`` [tokens, kv_heads, dim] -> [tokens, heads * dim]."""
        md = get_attention_metadata()
        self.k_cache[md.slot_mapping] = k
        self.v_cache[md.slot_mapping] = v
        keys = self.k_cache[md.key_slots].transpose(1, 2)  # [seqs, kv_heads, context, dim]
        values = self.v_cache[md.key_slots].transpose(1, 2)
        queries = q[md.query_index].transpose(1, 2)  # [seqs, heads, max_query, dim]
        out = F.scaled_dot_product_attention(queries, keys, values, attn_mask=md.attn_mask, scale=self.scale,
                                             enable_gqa=self.num_heads != self.num_kv_heads)
        out = out.transpose(1, 2).reshape(-1, self.num_heads * self.head_dim)  # [seqs * max_query, heads * dim]
        return out[md.token_index]
