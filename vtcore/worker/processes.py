"""Where vtcore's child processes come from: the tensor-parallel workers and the engine core process.

They are forked from multiprocessing's fork server, which has imported torch and the child's module once,
so a child starts in tens of milliseconds where a spawned one imports torch again (about 2 s on a 2-core
machine, paid by each engine whose workers are new). The fork server is a fresh interpreter that never
touches CUDA, so its children may use it (a fork of a process that has initialised CUDA may not). As with
spawn, a child first imports the parent's main module (a script that starts engines at its top level needs
a main guard). Its ``os.environ`` is the parent's as the child starts; what the preloaded modules read at
import (torch's thread count from ``OMP_NUM_THREADS``, ``TRITON_INTERPRET``) is as the fork server started,
with the first child this process started, whose preload list is the one that counts. Where the platform has
no fork server (Windows), children are spawned.
"""
from __future__ import annotations

import multiprocessing
import os
from multiprocessing.connection import Connection
from typing import Any, Callable, Sequence

_METHOD = "forkserver" if "forkserver" in multiprocessing.get_all_start_methods() else "spawn"


def start_child(target: Callable[..., None], args: tuple, name: str, daemon: bool, preload: Sequence[str] = ()) -> Any:
    """Start ``target(*args)`` in a new process (a ``multiprocessing`` process, started) with this process's
    environment. The first child also starts the fork server, which imports torch, ``target``'s module and the
    modules of ``preload`` (those the child imports as it starts: imported once; none may initialise CUDA)."""
    context = multiprocessing.get_context(_METHOD)
    if _METHOD == "forkserver":  # (no effect once the server runs)
        context.set_forkserver_preload(["torch", target.__module__, *preload])
    process = context.Process(target=_child, args=(dict(os.environ), target, args), name=name, daemon=daemon)
    process.start()
    return process


def pipe() -> tuple[Connection, Connection]:
    """A duplex pipe whose ends may be handed to ``start_child``'s children."""
    return multiprocessing.get_context(_METHOD).Pipe()


def _child(environ: dict[str, str], target: Callable[..., None], args: tuple) -> None:
    os.environ.clear()
    os.environ.update(environ)
    target(*args)
