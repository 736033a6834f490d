"""A plugin registering two families under one architecture (the later would silently win)."""
from vtcore import hookimpl
from vtcore.family import ModelFamily


@hookimpl
def vtcore_model_families() -> list[ModelFamily]:
    return [ModelFamily(name="self_dup_a", architectures=("SelfDupForCausalLM",), model_cls="fixture_plugins.self_dup:A"),
            ModelFamily(name="self_dup_b", architectures=("SelfDupForCausalLM",), model_cls="fixture_plugins.self_dup:B")]
