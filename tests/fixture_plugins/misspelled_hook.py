"""A plugin whose hook name has a typo (``familes``): pluggy has no spec for it."""
from vtcore import hookimpl
from vtcore.family import ModelFamily


@hookimpl
def vtcore_model_familes() -> list[ModelFamily]:
    return [ModelFamily(name="misspelled", architectures=("MisspelledForCausalLM",),
                        model_cls="fixture_plugins.misspelled_hook:NoSuchModel")]
