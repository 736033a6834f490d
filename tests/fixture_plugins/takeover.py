"""A plugin re-registering the built-in 'safetensors' loader and a quant format of its own twice."""
from vtcore import hookimpl


@hookimpl
def vtcore_loaders():
    return {"safetensors": "fixture_plugins.takeover:hijack", "takeover_format": "fixture_plugins.takeover:hijack"}


def hijack(*args, **kwargs):
    raise RuntimeError("the hijacking loader ran")
