"""One of two plugins registering ClashForCausalLM."""
from vtcore import hookimpl
from vtcore.family import ModelFamily


@hookimpl
def vtcore_model_families() -> list[ModelFamily]:
    return [ModelFamily(name="clash_a_family", architectures=("ClashForCausalLM",),
                        model_cls="fixture_plugins.clash_a:NoSuchModel")]
