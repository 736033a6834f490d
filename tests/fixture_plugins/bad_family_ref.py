"""A plugin whose ModelFamily has a model_cls that is not a lazy 'module:Class' reference."""
from vtcore import hookimpl
from vtcore.family import ModelFamily


@hookimpl
def vtcore_model_families() -> list[ModelFamily]:
    return [ModelFamily(name="bad_ref", architectures=("BadRefForCausalLM",),
                        model_cls="fixture_plugins.bad_family_ref.NoColonHere")]
