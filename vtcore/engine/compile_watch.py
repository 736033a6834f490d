"""A log line for each Triton kernel variant compiled (or loaded from Triton's disk cache) once the first
engine on a GPU in a process is built and warmed up: one during serving stalls the step that met it (up
to a second on a cold cache), so a TTFT outlier can be traced to the kernel and the specialisation it
needed (``vtcore bench --serve`` counts these lines in the server's log during each timed run). The
hook stays for the process: a later engine's own build is logged too."""
from __future__ import annotations

import logging
from typing import Any

log = logging.getLogger("vtcore")

#: the start of each line, which ``vtcore bench --serve`` looks for in the server's log
MARK = "Triton compiled "
_watching = False


def watch_triton_compiles() -> None:
    """Install (once a process) Triton's cache-miss hook: it logs a warning naming the kernel variant and
    calls the hook that was there before."""
    global _watching
    if _watching:
        return
    try:
        from triton import knobs
    except ImportError:  # Triton absent: nothing compiles
        return
    previous = knobs.runtime.jit_cache_hook

    def hook(**kwargs: Any) -> Any:
        log.warning("%s%s: %s", MARK, getattr(kwargs.get("fn"), "name", "?"), kwargs.get("repr", ""))
        return previous(**kwargs) if previous else None

    knobs.runtime.jit_cache_hook = hook
    _watching = True
