"""Per-request recurrent state: the hybrid cache's second group, beside the paged KV cache.

A ``StatefulLayer`` (a linear-attention or SSM layer) declares the state one request needs
(``state_shapes``); the runner allocates ``num_slots`` of each (``allocate_state``) and gives every
running request a stable slot (its mirror slot). A request's first scheduled token of a
(re)computation starts from zero state; later chunks continue the slot's state; preemption drops
it (the recompute starts over). A finished request's slot is reusable at once: every step's device
work is ordered on one stream, so the next owner's reset lands after the old owner's last write.

Prefix caching (the snapshot contract): a cached prefix resumes from every stateful layer's state
at the prefix's end, kept in snapshot slots after the running requests' slots of the same tensors.
A layer takes part by declaring ``supports_state_snapshots`` and keeping all of a request's state
in ``states`` (slot first: the runner restores and saves a snapshot by copying slots), and, in a
general step, by honouring ``AttentionMetadata.state_out_slots``: a segment's state starts from its
``state_slots`` entry and ends in its ``state_out_slots`` entry (the runner splits a sequence where
a snapshot falls inside it, so the first part writes the snapshot). A family with a stateful layer
that does not declare it runs without prefix caching.
"""
from __future__ import annotations

import torch
from torch import nn


class StatefulLayer(nn.Module):
    """A layer whose per-request state lives in runner-allocated slots.

    ``supports_decode_graphs``: the layer decodes from ``AttentionMetadata.state_index`` /
    ``state_continues`` (device tensors) when they are set, so the runner may pad and capture its
    decode steps; a layer that only reads the host lists keeps its model eager.
    ``supports_chunk_graphs``: the layer also runs a lone prefill chunk from those device tensors and
    ``AttentionMetadata.state_tokens`` (rows past that count are padding, which must neither read nor
    change the state), so the runner may pad and capture such steps too.
    ``supports_verify_graphs``: the layer also runs verify rows (speculative decoding) from those device
    tensors and ``AttentionMetadata.state_out_index`` (the state after each row to its slot), so the
    runner may pad and capture verify steps too.
    ``supports_state_snapshots``: the layer keeps the snapshot contract above, so its family can
    cache prefixes.
    """

    supports_decode_graphs = False
    supports_chunk_graphs = False
    supports_verify_graphs = False
    supports_state_snapshots = False

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


def stateful_layers(module: nn.Module) -> list[StatefulLayer]:
    """``module``'s stateful layers, in module order."""
    return [m for m in module.modules() if isinstance(m, StatefulLayer)]


def copy_states(layers: list[StatefulLayer], dst: int | torch.Tensor, src: int | torch.Tensor) -> None:
    """``state[dst] = state[src]`` in every state of ``layers``: one slot (ints) or several (index tensors)."""
    for layer in layers:
        for t in layer.states.values():
            t[dst] = t[src]
