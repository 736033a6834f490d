"""A hook implementation asking for an argument its hookspec does not pass."""
from vtcore import hookimpl


@hookimpl
def vtcore_model_families(not_an_argument):
    return []
