"""A log line for each Triton kernel variant compiled (or loaded from Triton's disk cache) once the first
engine on a GPU in a process is built and warmed up: one during serving stalls the step that met it (up
to a second on a cold cache), so a TTFT outlier can be traced to the kernel and the specialisation it
needed (``vtcore bench --serve`` counts these lines in the server's log during each timed run). The
hook stays for the process: a later engine's own build is logged too."""
from __future__ import annotations

import logging
from typing import Any, Callable

log = logging.getLogger("vtcore")

#: the start of each line, which ``vtcore bench --serve`` looks for in the server's log
MARK = "Triton compiled "
_watching = False


def on_triton_compile(observe: Callable[[str, str], None]) -> Callable[[], None]:
    """Chain ``observe(kernel name, specialisation)`` in front of Triton's cache-miss hook (a variant compiled
    or loaded from disk, from any thread); returns what puts the previous hook back (a no-op without Triton)."""
    try:
        from triton import knobs
    except ImportError:  # Triton absent: nothing compiles
        return lambda: None
    previous = knobs.runtime.jit_cache_hook

    def hook(**kwargs: Any) -> Any:
        observe(getattr(kwargs.get("fn"), "name", "?"), kwargs.get("repr", ""))
        return previous(**kwargs) if previous else None  # (a truthy result would make Triton skip the compile)

    knobs.runtime.jit_cache_hook = hook

    def restore() -> None:
        knobs.runtime.jit_cache_hook = previous
    return restore


def watch_triton_compiles() -> None:
    """Install (once a process) a hook that logs a warning naming each kernel variant compiled."""
    global _watching
    if not _watching:
        on_triton_compile(lambda name, spec: log.warning("%s%s: %s", MARK, name, spec))
        _watching = True
