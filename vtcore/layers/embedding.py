"""EmbedInto, the shared vocabulary embedding, and the device-token override scope.

In async serving the host prepares step N+1 before step N's sampled tokens reach it, so the host
input ids of N+1's decode rows hold the placeholder -1. The runner opens ``device_token_scope``
around every forward with the real ids as a device tensor; ``EmbedInto`` embeds those instead of
the host ids. A model that bypasses EmbedInto embeds -1 (an index error on CPU, garbage on a GPU),
and EmbedInto itself raises ``DeviceTokenOverrideIgnored`` when the runner marked the host ids
stale but opened no override, so an ignored override fails every time, not by chance.
"""
from __future__ import annotations

import threading
from contextlib import contextmanager
from typing import Iterator

import torch
from torch import nn

from vtcore.errors import DeviceTokenOverrideIgnored
from vtcore.layers import parallel as tp
from vtcore.layers.linear import copy_checked, loadable_param


class TokenOverride:
    """The override in scope for one forward: the device ids and whether an EmbedInto used them."""

    __slots__ = ("device_ids", "host_ids_stale", "consumed")

    def __init__(self, device_ids: torch.Tensor | None, host_ids_stale: bool) -> None:
        self.device_ids = device_ids
        self.host_ids_stale = host_ids_stale
        self.consumed = False


_scope = threading.local()


def current_override() -> TokenOverride | None:
    """The override the runner opened for the forward running on this thread, if any."""
    return getattr(_scope, "override", None)


@contextmanager
def device_token_scope(device_ids: torch.Tensor | None, host_ids_stale: bool) -> Iterator[TokenOverride]:
    """Open the device-token override for one forward.

    ``device_ids`` is the step's device input-id tensor (same shape as the host ids the model is
    called with) or None when the host ids are current; ``host_ids_stale`` says whether the host
    ids hold placeholders. Yields the ``TokenOverride`` so the caller can see if it was consumed.
    """
    previous = current_override()
    override = TokenOverride(device_ids, host_ids_stale)
    _scope.override = override
    try:
        yield override
    finally:
        _scope.override = previous


class EmbedInto(nn.Module):
    """A vocabulary embedding that honours the device-token override. Every family embeds with it."""

    tp_sharded = True  # its rank's slice of the vocabulary (vtcore.layers.parallel)
    vocab_start = 0  # the first id of that slice (class defaults: a wrapper need not call __init__)
    tp_group = tp.TensorParallel()

    def __init__(self, num_embeddings: int, embedding_dim: int) -> None:
        """Under tensor parallelism (:mod:`vtcore.layers.parallel`) it holds its rank's slice of the
        vocabulary (``vocab_start``, ``num_local``), and the partial lookups are summed over the ranks."""
        super().__init__()
        self.num_embeddings = num_embeddings
        self.embedding_dim = embedding_dim
        num_local = tp.split(num_embeddings, "vocab_size")
        self.tp_group = tp.tp()
        self.vocab_start = self.tp_group.rank * num_local
        self.weight = loadable_param(torch.empty(num_local, embedding_dim), (None,), self.weight_loader)
        self.family = "<unknown>"  # set by the model builder, for the error message

    @property
    def num_local(self) -> int:
        """The ids this rank embeds (all of them at tensor-parallel size 1)."""
        return self.weight.shape[0]

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard: str | None = None) -> None:
        """The rank's rows of the whole checkpoint embedding."""
        copy_checked(param.data, tp.rank_part(loaded, 0, self.tp_group))

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        override = current_override()
        if override is not None:
            if override.device_ids is not None:
                override.consumed = True
                input_ids = override.device_ids
            elif override.host_ids_stale:
                raise DeviceTokenOverrideIgnored(self.family)
        if not self.tp_group.collective:
            return nn.functional.embedding(input_ids, self.weight)
        local = input_ids - self.vocab_start
        mine = (local >= 0) & (local < self.num_local)
        out = nn.functional.embedding(torch.where(mine, local, 0), self.weight) * mine[:, None].to(self.weight.dtype)
        return tp.all_reduce(out, self.tp_group)
