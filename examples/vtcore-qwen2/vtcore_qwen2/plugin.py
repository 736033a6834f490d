"""Hook implementations: register the Qwen2 family and its conformance example."""
from __future__ import annotations

from vtcore import hookimpl
from vtcore.family import ConformanceExample, ModelFamily


@hookimpl
def vtcore_model_families() -> list[ModelFamily]:
    return [ModelFamily(
        name="qwen2",
        architectures=("Qwen2ForCausalLM",),
        model_cls="vtcore_qwen2.model:Qwen2ForCausalLM",
        consumes_device_tokens=True,  # it embeds through vtcore's EmbedInto
        conformance_example="vtcore_qwen2.plugin:conformance_example",
    )]


def conformance_example() -> ConformanceExample:
    """Two layers, GQA (4 query heads, 2 kv heads), head_dim from hidden / heads (Qwen2 configs give
    none), Qwen2's rope_theta of 1e6; the sliding-window fields left at their defaults (off)."""
    return ConformanceExample(
        hf_config={
            "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "vocab_size": 512, "hidden_size": 64,
            "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
            "max_position_embeddings": 256, "rms_norm_eps": 1e-6, "tie_word_embeddings": False,
            "initializer_range": 0.1, "torch_dtype": "float32",
            "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0},
        },
        oracle="transformers:Qwen2ForCausalLM",
    )
