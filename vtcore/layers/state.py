"""Per-request recurrent state: the hybrid cache's second group, beside the paged KV cache.

A ``StatefulLayer`` (a linear-attention or SSM layer) declares the state one request needs
(``state_shapes``); the runner allocates ``num_slots`` of each (``allocate_state``) and gives every
running request a stable slot (its mirror slot). A request's first scheduled token of a
(re)computation starts from zero state; later chunks continue the slot's state; preemption drops
it (the recompute starts over). A finished request's slot is reusable at once: every step's device
work is ordered on one stream, so the next owner's reset lands after the old owner's last write.
"""
from __future__ import annotations

import torch
from torch import nn


class StatefulLayer(nn.Module):
    """A layer whose per-request state lives in runner-allocated slots.

    ``supports_decode_graphs``: the layer decodes from ``AttentionMetadata.state_index`` /
    ``state_continues`` (device tensors) when they are set, so the runner may pad and capture its
    decode steps; a layer that only reads the host lists keeps its model eager.
    """

    supports_decode_graphs = False

    def __init__(self) -> None:
        super().__init__()
        self.states: dict[str, torch.Tensor] = {}

    def state_shapes(self) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        """Name -> (shape of one request's state, dtype)."""
        raise NotImplementedError

    def state_bytes(self) -> int:
        return sum(torch.Size(s).numel() * torch.empty((), dtype=d).element_size()
                   for s, d in self.state_shapes().values())

    def allocate_state(self, num_slots: int, device: torch.device) -> None:
        self.states = {name: torch.zeros((num_slots, *shape), dtype=dtype, device=device)
                       for name, (shape, dtype) in self.state_shapes().items()}
