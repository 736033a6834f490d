"""Tensor parallelism (Megatron-style) for vtcore's layers: the process's rank and group, and the collectives.

A model built while ``tensor_parallel(rank, size, group)`` is in effect holds only this rank's share: a
column-parallel Linear (``Linear(..., parallel="column")``: fused q/k/v, gate/up, an untied lm_head) keeps
its rows of every shard, a row-parallel one (``parallel="row"``: o_proj, down_proj) its columns, and sums
its output over the group (an all-reduce; its bias added once); attention keeps its heads (key/value heads
split too, or replicated where there are fewer than ranks); ``EmbedInto`` keeps its slice of the vocabulary
and sums the partial lookups; logits are gathered. Every rank runs the same forward on the same inputs.
The weight loaders take whole checkpoint tensors and keep their rank's part. Outside the context (the
default) the size is 1 and every layer is whole: nothing here runs.
"""
from __future__ import annotations

import contextlib
from typing import Any, Iterator

import attrs
import torch


@attrs.frozen
class TensorParallel:
    rank: int = 0
    size: int = 1
    group: Any = None  # a torch.distributed process group (None: the default group)

    @property
    def collective(self) -> bool:
        """Whether the collectives run: at a size above 1, and over a group of one rank given at size 1 (each
        collective then returns its input, as at size 1 without a group; what lets one GPU run the model's NCCL
        calls, inside CUDA graphs too)."""
        return self.size > 1 or self.group is not None


_current = TensorParallel()


def tp() -> TensorParallel:
    """The tensor-parallel rank and size models are built for now (size 1: no parallelism)."""
    return _current


@contextlib.contextmanager
def tensor_parallel(rank: int, size: int, group: Any = None) -> Iterator[TensorParallel]:
    """Build (and run) models as rank ``rank`` of ``size``; ``torch.distributed`` must be initialised."""
    global _current
    if not 0 <= rank < size:
        raise ValueError(f"tensor parallel rank={rank}: expected 0 <= rank < size={size}")
    previous, _current = _current, TensorParallel(rank, size, group)
    try:
        yield _current
    finally:
        _current = previous


def refuse_unsharded(model: torch.nn.Module) -> None:
    """The contract for a layer of a family's own, at a size above 1: a module that owns parameters either
    shards them itself as it is built (``tp_sharded = True``: ``Linear``, ``EmbedInto``) or declares them the
    same on every rank (``tp_replicated = True``: norms). Anything else would run whole on every rank, on
    sharded inputs; the first such module is refused by name."""
    if _current.size == 1:
        return
    for name, module in model.named_modules():
        owns = any(True for _ in module.parameters(recurse=False))
        if owns and not (getattr(module, "tp_sharded", False) or getattr(module, "tp_replicated", False)):
            raise ValueError(f"tensor_parallel_size={_current.size}: module {name!r} ({type(module).__name__}) owns "
                             f"parameters it does not shard; a layer of a family's own must shard itself or declare "
                             f"its parameters replicated (tp_replicated = True; vtcore.layers.parallel)")


def materialize(x: Any) -> torch.Tensor:
    """``x`` itself if it is a tensor, else the elements it selects, read now (the loaders hand ranks
    ``vtcore.loading.lazy.LazySlice`` views, so that a rank reads only its part of each tensor)."""
    return x.materialize() if hasattr(x, "materialize") else x


def rank_part(loaded: torch.Tensor, dim: int, group: TensorParallel, segments: list[int] | None = None
              ) -> torch.Tensor:
    """``group``'s rank's part of a whole tensor along ``dim`` (the group a layer was built for): of each of
    ``segments`` (consecutive lengths along ``dim``, each split in equal parts over the ranks; default the
    whole length); the tensor itself at size 1."""
    if group.size == 1:
        return loaded
    whole = segments or [loaded.shape[dim]]
    if loaded.shape[dim] != sum(whole):
        raise ValueError(f"shape {tuple(loaded.shape)}, expected {sum(whole)} along dimension {dim}")
    parts = [t.narrow(dim, group.rank * (n // group.size), n // group.size)
             for t, n in zip(loaded.split(whole, dim), whole)]
    return parts[0] if len(parts) == 1 else torch.cat([materialize(p) for p in parts], dim)


def split(total: int, what: str) -> int:
    """This rank's share of ``total`` (heads, rows, vocabulary), refused by name when it does not divide."""
    size = _current.size
    if total % size:
        raise ValueError(f"tensor_parallel_size={size} does not divide {what}={total}")
    return total // size


def all_reduce(x: torch.Tensor, group: TensorParallel) -> torch.Tensor:
    """The sum of ``x`` over ``group`` (the one a layer was built for; in place, ``x`` itself at size 1).
    ``group.group``: a process group object of its own (an engine's ranks), or None for torch.distributed's
    default group."""
    if group.collective:
        if group.group is None:
            torch.distributed.all_reduce(x)
        else:
            group.group.allreduce([x]).wait()
    return x


def all_gather_last(x: torch.Tensor, group: TensorParallel) -> torch.Tensor:
    """The ranks' ``x`` concatenated along the last dimension, in rank order (``x`` itself at size 1)."""
    if not group.collective:
        return x
    parts = [torch.empty_like(x) for _ in range(group.size)]
    if group.group is None:
        torch.distributed.all_gather(parts, x.contiguous())
    else:
        group.group.allgather([parts], [x.contiguous()]).wait()
    return torch.cat(parts, dim=-1)


def broadcast(x: torch.Tensor, group: TensorParallel) -> torch.Tensor:
    """Rank 0's ``x`` on every rank (in place; ``x`` itself at size 1)."""
    if group.collective:
        if group.group is None:
            torch.distributed.broadcast(x, src=0)
        else:
            group.group.broadcast(x, 0).wait()
    return x
