"""Hook implementation: register the nvfp4-pack-quantized format."""
from __future__ import annotations

from vtcore import hookimpl


@hookimpl
def vtcore_quant_methods() -> dict[str, str]:
    return {"nvfp4-pack-quantized": "vtcore_quant_nvfp4.method:NVFP4Method"}
