"""Hook implementation: register the mxfp4-pack-quantized format."""
from __future__ import annotations

from vtcore import hookimpl


@hookimpl
def vtcore_quant_methods() -> dict[str, str]:
    return {"mxfp4-pack-quantized": "vtcore_quant_mxfp4.method:MXFP4Method"}
