"""Fixture plugin: Qwen3 variants that each break one part of the contract, on purpose.

Every family but ``no_example`` carries a conformance example whose oracle is HF's Qwen3 class,
so the gate can show which single check each one fails.
"""
from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

from vtcore import hookimpl
from vtcore.family import ConformanceExample, ModelFamily
from vtcore.layers.linear import Linear
from vtcore_qwen3_dense.model import Qwen3ForCausalLM
from vtcore_qwen3_dense.plugin import conformance_example as qwen3_example

HERE = "tests.fixture_async.families"


class _HostEmbedding(nn.Module):
    """Embeds whatever host ids it is given: ignores the device-token override."""

    def __init__(self, weight: nn.Parameter) -> None:
        super().__init__()
        self.weight = weight

    def forward(self, input_ids):
        return F.embedding(input_ids, self.weight)


class IgnoresOverride(Qwen3ForCausalLM):
    """Keeps an EmbedInto around (so the structure check passes) but embeds with its own module."""

    def __init__(self, config, max_position: int) -> None:
        super().__init__(config, max_position)
        self.unused_embed = self.model.embed_tokens
        self.model.embed_tokens = _HostEmbedding(self.unused_embed.weight)


class SwappedGateUp(Qwen3ForCausalLM):
    """Loads gate_proj into the up rows and up_proj into the gate rows: a wrong weight mapping."""

    packed_modules_mapping = {**Qwen3ForCausalLM.packed_modules_mapping,
                              "gate_proj": ("gate_up_proj", "up"), "up_proj": ("gate_up_proj", "gate")}


class LossyLoad(Qwen3ForCausalLM):
    """Rounds one weight through bfloat16 while loading: close, but not the checkpoint's bits."""

    def __init__(self, config, max_position: int) -> None:
        super().__init__(config, max_position)
        o_proj = self.model.layers[0].self_attn.o_proj

        def lossy(param, loaded, shard=None):
            Linear.weight_loader(o_proj, param, loaded.to(torch.bfloat16).float(), shard)

        o_proj.weight.weight_loader = lossy


def _example(arch: str, **overrides: Any) -> ConformanceExample:
    base = qwen3_example()
    return ConformanceExample(hf_config={**base.hf_config, "architectures": [arch], **overrides}, oracle=base.oracle)


def ignores_override_example() -> ConformanceExample:
    return _example("IgnoresOverrideForCausalLM")


def undeclared_example() -> ConformanceExample:
    return _example("UndeclaredForCausalLM")


def one_layer_example() -> ConformanceExample:
    return _example("OneLayerForCausalLM", num_hidden_layers=1)


def flat_example() -> ConformanceExample:
    # Tied embeddings and near-zero layers: the model echoes its last token.
    return _example("FlatForCausalLM", initializer_range=1e-3, tie_word_embeddings=True)


def swapped_example() -> ConformanceExample:
    return _example("SwappedGateUpForCausalLM")


def lossy_example() -> ConformanceExample:
    return _example("LossyLoadForCausalLM")


def wrong_model_type_example() -> ConformanceExample:
    # qwen3_moe configs build other tensor names: the gate would blame the family for them
    return _example("WrongModelTypeForCausalLM", model_type="qwen3_moe")


@hookimpl
def vtcore_model_families() -> list[ModelFamily]:
    qwen3 = "vtcore_qwen3_dense.model:Qwen3ForCausalLM"
    return [
        ModelFamily(name="ignores_override", architectures=("IgnoresOverrideForCausalLM",),
                    model_cls=f"{HERE}:IgnoresOverride", consumes_device_tokens=True,
                    conformance_example=f"{HERE}:ignores_override_example"),
        ModelFamily(name="undeclared", architectures=("UndeclaredForCausalLM",), model_cls=qwen3,
                    consumes_device_tokens=False, conformance_example=f"{HERE}:undeclared_example"),
        ModelFamily(name="no_example", architectures=("NoExampleForCausalLM",), model_cls=qwen3,
                    consumes_device_tokens=True),
        ModelFamily(name="one_layer", architectures=("OneLayerForCausalLM",), model_cls=qwen3,
                    consumes_device_tokens=True, conformance_example=f"{HERE}:one_layer_example"),
        ModelFamily(name="flat", architectures=("FlatForCausalLM",), model_cls=qwen3,
                    consumes_device_tokens=True, conformance_example=f"{HERE}:flat_example"),
        ModelFamily(name="swapped_gate_up", architectures=("SwappedGateUpForCausalLM",),
                    model_cls=f"{HERE}:SwappedGateUp", consumes_device_tokens=True,
                    conformance_example=f"{HERE}:swapped_example"),
        ModelFamily(name="lossy_load", architectures=("LossyLoadForCausalLM",), model_cls=f"{HERE}:LossyLoad",
                    consumes_device_tokens=True, conformance_example=f"{HERE}:lossy_example"),
        ModelFamily(name="wrong_model_type", architectures=("WrongModelTypeForCausalLM",), model_cls=qwen3,
                    consumes_device_tokens=True, conformance_example=f"{HERE}:wrong_model_type_example"),
    ]
