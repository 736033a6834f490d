"""Hook implementations: register the Llama family and its conformance example."""
from __future__ import annotations

from vtcore import hookimpl
from vtcore.family import ConformanceExample, ModelFamily


@hookimpl
def vtcore_model_families() -> list[ModelFamily]:
    return [ModelFamily(
        name="llama",
        architectures=("LlamaForCausalLM",),
        model_cls="vtcore_llama.model:LlamaForCausalLM",
        consumes_device_tokens=True,  # it embeds through vtcore's EmbedInto
        conformance_example="vtcore_llama.plugin:conformance_example",
    )]


def conformance_example() -> ConformanceExample:
    """Two layers, GQA, llama3 RoPE scaling with a short original context so the scaling bites."""
    return ConformanceExample(
        hf_config={
            "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 512, "hidden_size": 64,
            "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
            "head_dim": 16, "max_position_embeddings": 256, "rms_norm_eps": 1e-5, "tie_word_embeddings": False,
            "initializer_range": 0.1,
            "rope_parameters": {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
                                "high_freq_factor": 4.0, "original_max_position_embeddings": 32},
        },
        oracle="transformers:LlamaForCausalLM",
    )
