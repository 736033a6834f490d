"""Hook implementations: the Qwen3.5 dense and MoE families, their conformance examples, their
multi-token-prediction head and their tool-call format (Qwen3.5's XML calls)."""
from __future__ import annotations

from typing import Any

from vtcore import hookimpl
from vtcore.family import ConformanceExample, ModelFamily

_TINY: dict[str, Any] = {
    "vocab_size": 512, "hidden_size": 64, "num_hidden_layers": 4, "num_attention_heads": 4,
    "num_key_value_heads": 2, "head_dim": 16, "max_position_embeddings": 256, "rms_norm_eps": 1e-6,
    "layer_types": ["linear_attention", "full_attention", "linear_attention", "full_attention"],
    "linear_num_key_heads": 2, "linear_num_value_heads": 4, "linear_key_head_dim": 8, "linear_value_head_dim": 8,
    "linear_conv_kernel_dim": 4, "tie_word_embeddings": False, "initializer_range": 0.1,
    "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25},
}


#: What a quantizer leaves dense: the vision tower (served by no vtcore path) and, in the MoE, the
#: router and the shared expert's gate (one output each token routes by; llm-compressor's recipes
#: for Qwen MoE models ignore both).
_VISION_IGNORE = (r"re:.*visual\..*",)
_MOE_IGNORE = (*_VISION_IGNORE, r"re:.*\.mlp\.gate$", r"re:.*\.mlp\.shared_expert_gate$")


@hookimpl
def vtcore_model_families() -> list[ModelFamily]:
    return [
        ModelFamily(name="qwen3_5", architectures=("Qwen3_5ForCausalLM", "Qwen3_5ForConditionalGeneration"),
                    model_cls="vtcore_qwen3_5.model:Qwen3_5ForCausalLM", consumes_device_tokens=True,
                    conformance_example="vtcore_qwen3_5.plugin:dense_example", quant_ignore=_VISION_IGNORE),
        ModelFamily(name="qwen3_5_moe",
                    architectures=("Qwen3_5MoeForCausalLM", "Qwen3_5MoeForConditionalGeneration"),
                    model_cls="vtcore_qwen3_5.model:Qwen3_5MoeForCausalLM", consumes_device_tokens=True,
                    conformance_example="vtcore_qwen3_5.plugin:moe_example", quant_ignore=_MOE_IGNORE),
    ]


@hookimpl
def vtcore_mtp_head(family: ModelFamily, model: Any, hf_config: Any) -> Any:
    """Qwen3.5's MTP head (``mtp_num_hidden_layers`` full-attention layers, default 1), for its checkpoints'
    ``mtp.*`` tensors; None for a config that says it has none."""
    if family.name not in ("qwen3_5", "qwen3_5_moe") or int(hf_config.get("mtp_num_hidden_layers", 1)) <= 0:
        return None
    from vtcore_qwen3_5.model import build_mtp_head
    return build_mtp_head(hf_config, model)


@hookimpl
def vtcore_tool_parser(family: ModelFamily) -> type | None:
    if family.name not in ("qwen3_5", "qwen3_5_moe"):
        return None
    from vtcore.server.tool_calls import Qwen3XMLToolParser
    return Qwen3XMLToolParser


def dense_example() -> ConformanceExample:
    """Linear- and full-attention layers alternating, GDN with 2 key / 4 value heads, partial RoPE."""
    return ConformanceExample(hf_config={**_TINY, "architectures": ["Qwen3_5ForCausalLM"],
                                         "model_type": "qwen3_5_text", "intermediate_size": 128},
                              oracle="transformers:Qwen3_5ForCausalLM")


def moe_example() -> ConformanceExample:
    """As the dense one, with 8 experts, top-2 routing and a gated shared expert in every layer."""
    return ConformanceExample(hf_config={**_TINY, "architectures": ["Qwen3_5MoeForCausalLM"],
                                         "model_type": "qwen3_5_moe_text", "num_experts": 8, "num_experts_per_tok": 2,
                                         "moe_intermediate_size": 32, "shared_expert_intermediate_size": 48},
                              oracle="transformers:Qwen3_5MoeForCausalLM")
