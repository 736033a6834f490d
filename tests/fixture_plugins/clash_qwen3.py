"""A plugin that claims Qwen3ForCausalLM, which qwen3_dense already serves, plus one arch of its own."""
from vtcore import hookimpl
from vtcore.family import ModelFamily


@hookimpl
def vtcore_model_families() -> list[ModelFamily]:
    return [ModelFamily(name="clash_qwen3", architectures=("Qwen3ForCausalLM",),
                        model_cls="vtcore_qwen3_dense.model:Qwen3ForCausalLM")]
