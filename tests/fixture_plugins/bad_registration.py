"""A plugin whose registration hook returns a dict instead of a list of ModelFamily."""
from vtcore import hookimpl


@hookimpl
def vtcore_model_families():
    return {"name": "not_a_family", "architectures": ["BadRegForCausalLM"]}
