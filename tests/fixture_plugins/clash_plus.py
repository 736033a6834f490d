"""A plugin that clashes with qwen3_dense on Qwen3ForCausalLM and also brings an architecture and a loader of its own."""
from vtcore import hookimpl
from vtcore.family import ModelFamily


@hookimpl
def vtcore_model_families() -> list[ModelFamily]:
    return [ModelFamily(name="clash_plus", architectures=("Qwen3ForCausalLM", "ClashPlusForCausalLM"),
                        model_cls="vtcore_qwen3_dense.model:Qwen3ForCausalLM")]


@hookimpl
def vtcore_loaders() -> dict[str, str]:
    return {"clash_plus_format": "fixture_plugins.good_family:load_nothing"}
