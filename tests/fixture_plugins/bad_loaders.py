"""A plugin whose loader table maps a name to something that is not a lazy 'module:attr'."""
from vtcore import hookimpl


@hookimpl
def vtcore_loaders():
    return {"fixture_bad_loader": 42}
