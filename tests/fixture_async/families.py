"""Fixture plugin: Qwen3 variants that break the device-token contract on purpose."""
from __future__ import annotations

from torch import nn
from torch.nn import functional as F

from vtcore import hookimpl
from vtcore.family import ModelFamily
from vtcore_qwen3_dense.model import Qwen3ForCausalLM


class _HostEmbedding(nn.Module):
    """Embeds whatever host ids it is given: ignores the device-token override."""

    def __init__(self, weight: nn.Parameter) -> None:
        super().__init__()
        self.weight = weight

    def forward(self, input_ids):
        return F.embedding(input_ids, self.weight)


class IgnoresOverride(Qwen3ForCausalLM):
    def __init__(self, config, max_position: int) -> None:
        super().__init__(config, max_position)
        self.model.embed_tokens = _HostEmbedding(self.model.embed_tokens.weight)


@hookimpl
def vtcore_model_families() -> list[ModelFamily]:
    return [
        ModelFamily(name="ignores_override", architectures=("IgnoresOverrideForCausalLM",),
                    model_cls="tests.fixture_async.families:IgnoresOverride", consumes_device_tokens=True),
        ModelFamily(name="undeclared", architectures=("UndeclaredForCausalLM",),
                    model_cls="vtcore_qwen3_dense.model:Qwen3ForCausalLM", consumes_device_tokens=False),
    ]
