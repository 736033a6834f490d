"""Host time of the engine's step-path calls, per call, while a ``vtcore`` command runs (docs/BENCHMARKS.md).

    python3 scripts/engine_call_costs.py bench --model ... --structured-share 0.5   (any ``vtcore`` command)

Wraps the runner's and the sampler's calls on a step's way (prepare, sample, the late draw and its parts, the
copies to the host, the event record) with wall-clock timers, each charged to the phase it ran inside (the
innermost of ``step``, ``submit`` and ``draw_late`` on its thread; a phase's own total is listed as
``phase*``), and prints per (phase, call) the calls, the total milliseconds and the mean microseconds. Wall
time on the engine thread includes its waits for the GIL, which is the point: a torch call that costs 7 us
alone (``scripts/host_op_costs.py``) can cost 50 in the engine beside the event loop's thread.
"""
from __future__ import annotations

import collections
import functools
import sys
import threading
import time
from typing import Any, Callable

import vtcore.engine.llm_engine as llm_engine
import vtcore.kernels.masked_argmax as masked_argmax
import vtcore.worker.model_runner as model_runner
import vtcore.worker.sampler as sampler
from vtcore.cli.main import main

totals: dict[tuple[str, str], list[float]] = collections.defaultdict(lambda: [0.0, 0])
here = threading.local()


def timed(fn: Callable[..., Any], label: str, phase: str | None = None) -> Callable[..., Any]:
    """``fn`` charging its wall time to (the phase it runs in, ``label``); with ``phase``, it is that phase
    for the calls inside it."""
    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        outer = getattr(here, "phase", "-")
        if phase is not None:
            here.phase = phase
        start = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            here.phase = outer
            entry = totals[(outer, label)]
            entry[0] += time.perf_counter() - start
            entry[1] += 1
    return wrapper


def install() -> None:
    for owner, name, phase in [(llm_engine.LLMEngine, "step", "step"), (model_runner.ModelRunner, "submit", "submit"),
                               (model_runner.StepHandle, "draw_late", "draw_late")]:
        setattr(owner, name, timed(getattr(owner, name), f"{phase}*", phase))
    for owner, name in [(sampler.Sampler, "prepare"), (sampler.Sampler, "sample"), (sampler.Sampler, "_mask_buffer"),
                        (model_runner.ModelRunner, "sample"), (model_runner.ModelRunner, "_draw_late"),
                        (model_runner.ModelRunner, "_record"), (model_runner.ModelRunner, "_to_host"),
                        (model_runner.ModelRunner, "_results_to_host"), (model_runner.ModelRunner, "publish")]:
        setattr(owner, name, timed(getattr(owner, name), f"{owner.__name__}.{name}"))
    # module functions, where their callers look them up
    for module, name in [(sampler, "fill_bitmasks"), (sampler, "to_device"), (model_runner, "to_device"),
                         (masked_argmax, "masked_argmax")]:
        setattr(module, name, timed(getattr(module, name), f"{module.__name__.rsplit('.', 1)[-1]}.{name}"))


if __name__ == "__main__":
    install()
    rc = main(sys.argv[1:])
    print(f"{'phase':12s} {'call':36s} {'calls':>7s} {'total ms':>10s} {'us/call':>9s}")
    for (phase, label), (seconds, calls) in sorted(totals.items(), key=lambda kv: (kv[0][0], -kv[1][0])):
        print(f"{phase:12s} {label:36s} {calls:7d} {seconds * 1e3:10.1f} {seconds / calls * 1e6:9.1f}")
    sys.exit(rc)
