"""A well-behaved plugin: registers one family serving two architectures (never built)."""
from vtcore import hookimpl
from vtcore.family import ModelFamily


@hookimpl
def vtcore_model_families() -> list[ModelFamily]:
    return [ModelFamily(
        name="fixture_family",
        architectures=("FixtureForCausalLM", "FixtureMoeForCausalLM"),
        model_cls="fixture_plugins.good_family:NoSuchModel",
    )]


@hookimpl
def vtcore_loaders() -> dict[str, str]:
    return {"fixture_format": "fixture_plugins.good_family:load_nothing"}


def load_nothing(model, model_path, hf_config, seed) -> None:
    """A loader that is registered but never used by the tests."""
