"""A plugin wrapping every EmbedInto in a counting subclass that shares the original weight.

``CALLS["hook"]`` counts hook calls (one per EmbedInto per model build), ``CALLS["forward"]``
counts forwards of the replacement. torch is imported only when a model is built.
"""
from vtcore import hookimpl

CALLS = {"hook": 0, "forward": 0}


def reset() -> None:
    CALLS.update(hook=0, forward=0)


@hookimpl
def vtcore_embed_into(family, embed):
    from fixture_plugins._counting_embed_impl import CountingEmbedInto

    CALLS["hook"] += 1
    return CountingEmbedInto(embed, CALLS)
