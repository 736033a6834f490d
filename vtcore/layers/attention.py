"""Paged attention: new K/V go into a block-paged cache, queries attend over it.

The runner sets one ``AttentionMetadata`` per forward (``set_attention_metadata``); every
attention layer of the model reads it. The cache of a layer is ``[num_blocks * block_size,
kv_heads, head_dim]`` for K and for V, indexed by slot (``block * block_size + offset``).
On CUDA the Triton kernels of ``vtcore.kernels.paged_attention`` run; elsewhere their torch
references (the same signatures, so both paths read the same metadata). A step that is one prompt's
first chunk (``AttentionMetadata.from_zero``) attends over its own K/V instead, through torch's SDPA: no
cached token can be seen, and on CUDA SDPA's fused kernel (cuDNN's on Hopper) beats the paged kernel on
whole prompts (docs/BENCHMARKS.md).
"""
from __future__ import annotations

import functools
import threading

import attrs
import torch
from torch import nn

from vtcore.kernels import paged_attention as kernels
from vtcore.kernels.rope import QKRope


@attrs.define
class AttentionMetadata:
    """Where this step's tokens go and what each query may see.

    ``slot_mapping`` [tokens]: the cache slot each new token's K/V is written to (-1: not written,
    the padded rows of a CUDA-graph batch).
    ``block_tables`` [seqs, blocks]: each sequence's cache blocks in position order.
    ``context_lens`` [seqs]: each sequence's length after this step's tokens.
    ``query_start_loc`` [seqs + 1]: sequence b's tokens are rows ``[start[b], start[b + 1])``, the
    last positions of its context.
    ``max_query_len`` / ``max_context_len``: host upper bounds (they size the kernels' grids, so a
    CUDA graph captures with its largest values). ``decode``: every sequence has one query.
    Host lists, for stateful (linear-attention) layers, one entry per state segment (a sequence's
    rows, split where the prefix cache takes a state snapshot): ``seq_rows`` (first row, token
    count), ``state_slots`` (the slot its state starts from), ``state_out_slots`` (the slot its
    state ends in; empty: the same as ``state_slots``) and ``has_state`` (False when its first
    token is position 0, so its state starts from zero). Segments of one sequence come in order,
    each starting from the slot the one before ended in. On the padded decode path (one token a
    row, captured in CUDA graphs) the same as device tensors instead: ``state_index`` [rows] int64
    (padded rows: the runner's dummy slot) and ``state_continues`` [rows] bool. On the padded path
    of a lone prefill chunk (one sequence of up to ``max_query_len`` rows, the rest padding) also
    ``state_tokens`` [1] int64: the chunk's real rows; its state ends after them, in its
    ``state_index`` slot. On the padded path of verify rows (speculative decoding: each row's fed
    token and its draft, ``max_query_len`` rows a sequence) ``state_index`` / ``state_continues``
    [seqs] and ``state_out_index`` [seqs, max_query_len] int64: the slot the state after each row is
    written to (-1: not written, a shorter draft's padding; a sequence's last real row: its own slot).
    ``from_zero``: the step is one sequence whose rows start at position 0 (a prompt's first chunk, no
    prefix cached): each row sees exactly the rows before it, so attention reads this step's K/V and not
    the cache. Rows padded at its end see the real rows before them, and no real row sees them.
    """

    slot_mapping: torch.Tensor
    block_tables: torch.Tensor
    context_lens: torch.Tensor
    query_start_loc: torch.Tensor
    max_query_len: int
    max_context_len: int
    seq_rows: list[tuple[int, int]] = attrs.Factory(list)
    state_slots: list[int] = attrs.Factory(list)
    state_out_slots: list[int] = attrs.Factory(list)
    has_state: list[bool] = attrs.Factory(list)
    state_index: torch.Tensor | None = None
    state_continues: torch.Tensor | None = None
    state_tokens: torch.Tensor | None = None
    state_out_index: torch.Tensor | None = None
    from_zero: bool = False

    @property
    def decode(self) -> bool:
        return self.max_query_len == 1


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
        self.block_size = 0  # set with the cache

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor | None = None,
                rotary: nn.Module | None = None, q_norm: nn.Module | None = None, k_norm: nn.Module | None = None
                ) -> torch.Tensor:
        """``q`` [tokens, heads, dim], ``k``/``v`` [tokens, kv_heads, dim] -> [tokens, heads * dim].

        With ``rotary`` (a ``RotaryEmbedding``) and ``positions``, q and k are first normed by
        ``q_norm``/``k_norm`` (when given) and rotated; on CUDA that and the cache write are one kernel."""
        md = get_attention_metadata()
        if rotary is not None:
            q, k = rotary(positions, q, k, q_norm, k_norm, kv_cache=(v, self.k_cache, self.v_cache, md.slot_mapping))
        else:
            (kernels.write_kv_cache if q.is_cuda else kernels.write_kv_cache_ref)(
                k, v, self.k_cache, self.v_cache, md.slot_mapping)
        # (a layer that overrides ``attend`` keeps it on every step; the cache write zeroed the K/V of padded
        # rows, slot -1, so no NaN they held reaches a real row through causal_attention's masked products)
        if md.from_zero and fused_sdpa(q) and type(self).attend is Attention.attend:
            return causal_attention(q, k, v, self.scale).reshape(-1, self.num_heads * self.head_dim)
        return self.attend(q)

    def decode_rope(self, positions: torch.Tensor, rotary: nn.Module, q_norm: nn.Module | None,
                    k_norm: nn.Module | None) -> QKRope | None:
        """The operands for a qkv GEMV that norms, rotates and caches this layer's q/k/v itself
        (:func:`vtcore.kernels.gemv.gemv_qk_rope`): a decode step of one token with RoPE over whole
        heads; else None."""
        md = get_attention_metadata()
        if not md.decode or positions.numel() != 1 or rotary.rotary_dim != self.head_dim:
            return None
        norm = q_norm or k_norm
        return QKRope(self.num_heads, self.num_kv_heads, self.head_dim, q_norm.weight if q_norm else None,
                      k_norm.weight if k_norm else None, norm.eps if norm else 0.0, bool(norm and norm.zero_centered),
                      rotary.cos_cache, rotary.sin_cache, positions, self.k_cache, self.v_cache, md.slot_mapping)

    def attend(self, q: torch.Tensor) -> torch.Tensor:
        """``q`` [tokens, heads, dim] (normed and rotated) over the cache, this step's K/V already in
        it -> [tokens, heads * dim]."""
        md = get_attention_metadata()
        triton = q.is_cuda
        if md.decode:
            args = (q, self.k_cache, self.v_cache, md.block_tables, md.context_lens, self.scale, self.block_size,
                    md.max_context_len)
            # early_reads: the kernel before this one (the qkv projection's cache write) wrote only each
            # sequence's last position, which is what the contract allows
            out = kernels.paged_decode_attention(*args, early_reads=True) if triton else \
                kernels.paged_decode_attention_ref(*args)
        else:
            out = (kernels.paged_prefill_attention if triton else kernels.paged_prefill_attention_ref)(
                q, self.k_cache, self.v_cache, md.block_tables, md.query_start_loc, md.context_lens, self.scale,
                self.block_size, md.max_query_len, md.max_context_len)
        return out.reshape(-1, self.num_heads * self.head_dim)


def fused_sdpa(q: torch.Tensor) -> bool:
    """Whether SDPA has a fused kernel for ``q``'s dtype, head size and device: on CUDA, FlashAttention and
    cuDNN take 16-bit types, head sizes up to 256 and Ampere or newer; otherwise (float32 with GQA, among
    others) SDPA falls back to its math backend, whose [heads, tokens, tokens] scores a long prompt cannot
    afford, and the paged kernel runs instead. On CPU SDPA's own kernel takes every case."""
    return not q.is_cuda or (q.dtype in (torch.float16, torch.bfloat16) and q.shape[-1] <= 256
                             and _capability(q.device.index) >= (8, 0))


@functools.lru_cache(maxsize=None)
def _capability(index: int | None) -> tuple[int, int]:
    return torch.cuda.get_device_capability(index)


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """``q`` [tokens, heads, dim] over ``k``/``v`` [tokens, kv_heads, dim] of the same tokens, each row seeing
    itself and the rows before it (GQA: query head h reads KV head h // (heads // kv_heads)) -> [tokens,
    heads, dim]. Torch's SDPA picks the kernel; the [1, heads, tokens, dim] views keep the tokens-major
    memory, which the fused kernels read as it is."""
    out = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None], is_causal=True, scale=scale,
        enable_gqa=q.shape[1] != k.shape[1])
    return out[0].transpose(0, 1)
