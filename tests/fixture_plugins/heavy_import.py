"""A plugin whose registration module imports a heavy module at its top (``_heavy_dep`` stands in for torch)."""
from fixture_plugins import _heavy_dep  # noqa: F401
from vtcore import hookimpl
from vtcore.family import ModelFamily


@hookimpl
def vtcore_model_families() -> list[ModelFamily]:
    return []
