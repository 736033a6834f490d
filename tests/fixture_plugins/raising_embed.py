"""A vtcore_embed_into hook that raises when a model is built."""
from vtcore import hookimpl


@hookimpl
def vtcore_embed_into(family, embed):
    raise RuntimeError("embed hook blew up")
