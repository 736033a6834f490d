"""Multi-token prediction (MTP) heads: a small predictor of the token after next, for speculative decoding.

As Qwen3-Next and Qwen3.5 ship it (``mtp.*`` tensors, read the same way by vLLM's MTP models): at
position p the head takes the embedding of the token at p + 1 and the target's hidden state at p (after
the target's final norm), RMS-norms each, concatenates them as [embedding | hidden] and projects the
2H-wide result to H with ``fc``; then one of its decoder layers (full attention over the head's own paged
KV cache, written at the same slots as the target's) and its final norm. The target's lm_head turns the
result into logits for the token at p + 2. The embedding and lm_head are the target's own: the head
holds neither, it reads the embedding through the model it is attached to (``model.mtp``).
"""
from __future__ import annotations

import torch
from torch import nn

from vtcore.layers.linear import Linear
from vtcore.layers.norm import RMSNorm


class MultiTokenPredictor(nn.Module):
    """``forward(input_ids, positions, hidden, step)``: the head's hidden states after its final norm.

    ``layers`` are pre-norm decoder layers (``(positions, x, residual) -> (x, residual)``); proposal step
    ``step`` of a chain (0 for the first token proposed) runs layer ``step % len(layers)``, as vLLM
    cycles them. ``embed_path``: where the target keeps its embedding (``model.get_submodule`` of the
    model the head is attached to, so a plugin's replacement EmbedInto is the one used).
    """

    def __init__(self, hidden_size: int, layers: list[nn.Module], eps: float, *, zero_centered: bool,
                 embed_path: str = "model.embed_tokens") -> None:
        super().__init__()
        self.pre_fc_norm_embedding = RMSNorm(hidden_size, eps, zero_centered=zero_centered)
        self.pre_fc_norm_hidden = RMSNorm(hidden_size, eps, zero_centered=zero_centered)
        self.fc = Linear(2 * hidden_size, hidden_size)
        self.layers = nn.ModuleList(layers)
        self.norm = RMSNorm(hidden_size, eps, zero_centered=zero_centered)
        self.embed_path = embed_path
        self._owner: tuple[nn.Module, ...] = ()  # the target model (a tuple: not a submodule of the head)

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    def attach(self, model: nn.Module) -> None:
        """Make the head ``model.mtp``: its parameters load under ``mtp.``, its attention layers get KV
        caches with the model's, and it embeds with the model's embedding."""
        model.mtp = self
        self._owner = (model,)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, hidden: torch.Tensor, step: int = 0
                ) -> torch.Tensor:
        """``input_ids`` [T] (the tokens one position ahead of ``hidden``'s), ``positions`` [T] (the
        hidden states' positions), ``hidden`` [T, H] the target's final-norm outputs (or this head's own,
        for a later step of a chain): [T, H]."""
        if not self._owner:
            raise RuntimeError("MultiTokenPredictor.forward before attach(model): the head embeds with its "
                               "target's embedding")
        embed = self._owner[0].get_submodule(self.embed_path)(input_ids)
        x = self.fc(torch.cat((self.pre_fc_norm_embedding(embed), self.pre_fc_norm_hidden(hidden)), dim=-1))
        x, residual = self.layers[step % len(self.layers)](positions, x, None)
        return self.norm(x, residual)[0]
