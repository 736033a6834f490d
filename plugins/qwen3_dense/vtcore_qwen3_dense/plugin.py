"""Hook implementations of the Qwen3 dense plugin: the family, its conformance example and its
tool-call format (hermes, as Qwen3's chat template writes tools)."""
from __future__ import annotations

from vtcore import hookimpl
from vtcore.family import ConformanceExample, ModelFamily


@hookimpl
def vtcore_model_families() -> list[ModelFamily]:
    return [ModelFamily(
        name="qwen3_dense",
        architectures=("Qwen3ForCausalLM",),
        model_cls="vtcore_qwen3_dense.model:Qwen3ForCausalLM",
        consumes_device_tokens=True,
        conformance_example="vtcore_qwen3_dense.plugin:conformance_example",
    )]


@hookimpl
def vtcore_tool_parser(family: ModelFamily) -> type | None:
    if family.name != "qwen3_dense":
        return None
    from vtcore.server.tool_calls import HermesToolParser
    return HermesToolParser


def conformance_example() -> ConformanceExample:
    """A 2-layer GQA Qwen3 small enough for CPU float32, checked against HF's Qwen3ForCausalLM."""
    return ConformanceExample(
        hf_config={
            "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "vocab_size": 512,
            "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
            "num_key_value_heads": 2, "head_dim": 16, "max_position_embeddings": 256, "rms_norm_eps": 1e-6,
            "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}, "tie_word_embeddings": False,
            "initializer_range": 0.1, "torch_dtype": "float32",
        },
        oracle="transformers:Qwen3ForCausalLM",
    )
