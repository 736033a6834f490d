"""vtcore's own pieces, registered through the same hooks as any plugin."""
from __future__ import annotations

from vtcore.family import ConformanceExample, ModelFamily, resolve_ref
from vtcore.plugins.hookspecs import hookimpl


@hookimpl
def vtcore_loaders() -> dict[str, str]:
    return {
        "safetensors": "vtcore.loading.safetensors_loader:load_safetensors",
        "auto": "vtcore.loading.safetensors_loader:load_safetensors",
        "dummy": "vtcore.loading.dummy_loader:load_dummy",
    }


@hookimpl(trylast=True)
def vtcore_conformance_example(family: ModelFamily) -> ConformanceExample | None:
    if family.conformance_example is None:
        return None
    return resolve_ref(family.conformance_example)()
