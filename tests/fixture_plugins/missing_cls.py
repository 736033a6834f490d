"""A family whose model class cannot be imported (registration is lazy, so it loads fine)."""
from vtcore import hookimpl
from vtcore.family import ModelFamily


@hookimpl
def vtcore_model_families() -> list[ModelFamily]:
    return [ModelFamily(name="missing_cls", architectures=("MissingClsForCausalLM",),
                        model_cls="fixture_plugins.no_such_module:Model")]
