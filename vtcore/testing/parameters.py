"""Oracle parameters away from their initial values, and what resetting each one does.

transformers initialises norm weights to 1 (0 where the norm is zero-centred), biases to 0 and
Gated DeltaNet's ``dt_bias`` to 1: a family that ignores such a tensor computes the same function
as the oracle at its init, and an oracle check cannot see it. ``redraw_constants`` moves every
tensor transformers initialised to a constant by a seeded draw of a trained model's spread, so
that a tensor a family drops or misreads moves the logits; the tensors it draws at random
(projections, embeddings, router, conv, ``A_log``) keep that seeded draw.

``reset_groups`` and ``reset`` undo them again, one tensor or one kind of tensor at a time: the gate
uses them to prove each tensor matters to the oracle (``parameters`` check) and, when a family
disagrees with its oracle, to name the tensor whose reset makes the oracle agree (the likely cause);
``swap_groups`` and ``swapped`` exchange two same-shaped tensors of one module (``k_proj`` and ``v_proj``), the
likely cause of a weight mapping that loads each into the other's place.
"""
from __future__ import annotations

import re
from contextlib import contextmanager
from typing import Iterator

import torch
from torch import nn

#: Standard deviation of the draw around a constant init: a trained norm weight's spread around its
#: mean is of this order, and at this size dropping one moves a tiny model's logprobs by 1e-2 or more.
SPREAD = 0.3


def redraw_constants(model: nn.Module, seed: int) -> dict[str, float]:
    """Redraw, in place, every parameter of ``model`` that holds one value everywhere (``c``) as
    ``c + SPREAD * N(0, 1)`` from a generator seeded ``seed``; returns name -> ``c`` of those redrawn."""
    gen = torch.Generator().manual_seed(seed)
    init: dict[str, float] = {}
    with torch.no_grad():
        for name, param in model.named_parameters():
            flat = param.detach().flatten()
            if flat.numel() and bool((flat == flat[0]).all()):
                init[name] = float(flat[0])
                noise = torch.randn(param.shape, generator=gen, dtype=torch.float32)
                param.copy_((init[name] + SPREAD * noise).to(param.dtype))
    return init


def init_value(name: str, init: dict[str, float]) -> float:
    """The value ``name`` resets to: its constant init when it had one, else 0."""
    return init.get(name, 0.0)


def reset_groups(model: nn.Module) -> list[tuple[str, list[str]]]:
    """Candidate resets, most specific first: each parameter; each parameter across layers
    (``model.layers.*.input_layernorm.weight``); each kind (a module class's parameter, e.g. every
    ``Qwen3RMSNorm.weight``). Returns (description, parameter names) pairs."""
    names = [n for n, _ in model.named_parameters()]
    groups: list[tuple[str, list[str]]] = [(n, [n]) for n in names]
    starred: dict[str, list[str]] = {}
    kinds: dict[str, list[str]] = {}
    for n in names:
        starred.setdefault(re.sub(r"\.\d+\.", ".*.", n), []).append(n)
        owner, _, leaf = n.rpartition(".")
        kinds.setdefault(f"every {type(model.get_submodule(owner)).__name__}.{leaf}", []).append(n)
    for key, members in (*starred.items(), *kinds.items()):
        if len(members) > 1 and all(members != g for _, g in groups):
            groups.append((f"{key} ({len(members)} tensors)", members))
    return groups


@contextmanager
def reset(model: nn.Module, names: list[str], init: dict[str, float]) -> Iterator[None]:
    """Within the block, the parameters ``names`` of ``model`` hold their reset value (``init_value``)."""
    params = dict(model.named_parameters())
    saved = {n: params[n].detach().clone() for n in names}
    try:
        with torch.no_grad():
            for n in names:
                params[n].fill_(init_value(n, init))
        yield
    finally:
        with torch.no_grad():
            for n, value in saved.items():
                params[n].copy_(value)


def swap_groups(model: nn.Module) -> list[tuple[str, list[tuple[str, str]]]]:
    """Candidate swaps, each of two same-shaped parameters of sibling modules (``self_attn.k_proj.weight`` and
    ``self_attn.v_proj.weight``) in every layer at once: a family whose weight mapping loads each into the other's
    place computes what the oracle with them swapped does. Returns (description, [(name, name)]) pairs."""
    params = dict(model.named_parameters())
    siblings: dict[tuple[str, str], list[str]] = {}  # (grandparent module, leaf) -> parameter names
    for n in params:
        owner, _, leaf = n.rpartition(".")
        siblings.setdefault((owner.rpartition(".")[0], leaf), []).append(n)
    groups: dict[str, list[tuple[str, str]]] = {}
    for names in siblings.values():
        for i, a in enumerate(names):
            for b in names[i + 1:]:
                if params[a].shape == params[b].shape:
                    key = " and ".join(re.sub(r"\.\d+\.", ".*.", n) for n in (a, b))
                    groups.setdefault(key, []).append((a, b))
    return [(f"{key} ({len(pairs)} pair{'s' if len(pairs) > 1 else ''})", pairs) for key, pairs in groups.items()]


@contextmanager
def swapped(model: nn.Module, pairs: list[tuple[str, str]]) -> Iterator[None]:
    """Within the block, each pair of ``model``'s parameters holds the other's values."""
    params = dict(model.named_parameters())

    def swap() -> None:
        with torch.no_grad():
            for a, b in pairs:
                held = params[a].detach().clone()
                params[a].copy_(params[b])
                params[b].copy_(held)
    swap()
    try:
        yield
    finally:
        swap()
