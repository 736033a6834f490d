"""The interpreter's thread switch interval in a process that runs the engine loop beside other threads.

Most torch calls release the GIL while they run. When the engine thread's call returns while another
thread (the asyncio loop streaming outputs, the core process's sender) runs Python, the engine thread
waits for the GIL until that thread blocks or the switch interval (5 ms by default) runs out, and
every such wait lands in a step's host time, which a decode step of a small model at high
concurrency is bound by. A shorter interval caps that wait (docs/BENCHMARKS.md has the A/B).
"""
from __future__ import annotations

import sys

#: the switch interval the engine's processes run with (seconds); never raised above what was set
ENGINE_SWITCH_INTERVAL_S = 2e-4


def favour_engine_thread() -> None:
    """Lower the process's switch interval to ``ENGINE_SWITCH_INTERVAL_S`` (a shorter one is kept)."""
    if sys.getswitchinterval() > ENGINE_SWITCH_INTERVAL_S:
        sys.setswitchinterval(ENGINE_SWITCH_INTERVAL_S)
