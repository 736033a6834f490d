"""The EmbedInto subclass the counting_embed plugin installs (imports torch, so imported lazily)."""
from torch import nn

from vtcore.layers.embedding import EmbedInto


class CountingEmbedInto(EmbedInto):
    """Embeds exactly like ``inner`` (same Parameter, so ties survive) and counts forwards."""

    def __init__(self, inner: EmbedInto, calls: dict) -> None:
        nn.Module.__init__(self)
        self.num_embeddings = inner.num_embeddings
        self.embedding_dim = inner.embedding_dim
        self.weight = inner.weight
        self.family = inner.family
        self.calls = calls

    def forward(self, input_ids):
        self.calls["forward"] += 1
        return super().forward(input_ids)
