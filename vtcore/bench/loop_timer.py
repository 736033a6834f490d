"""Where the engine thread's time goes, step by step, for ``vtcore bench``.

:class:`LoopTimer` wraps, while entered, the methods the engine loop calls (``LLMEngine.step`` and, inside
it, the scheduler's ``schedule``, the runner's ``submit``, a step handle's ``result`` and ``draw_late``) and
charges each moment of the engine thread to the innermost phase running then (exclusive time):

* ``schedule``, ``submit``: choosing the batch; staging and enqueueing its device work;
* ``wait``: blocked on an earlier step's tokens (the device is behind the host), publish included;
* ``late_draw``: a constrained row's mask filled and its second draw enqueued;
* ``apply_outputs``: the rest of ``step``: the prefix cache's new blocks registered (after the submit), tokens
  applied, matchers advanced, outputs built;
* ``between``: the engine thread outside ``step``, from one step's return to the next one's call (the
  async loop handing outputs to their callers, waiting for the GIL or for work).

Per step the phases add up to the loop's period, so a host-bound loop shows which phase to cut and a
device-bound one shows its slack as ``wait``. Nothing here imports torch at module import time.
"""
from __future__ import annotations

import time
from typing import Any, Callable

PHASES = ("schedule", "submit", "wait", "late_draw", "apply_outputs", "between")


class LoopTimer:
    """Exclusive time per phase of the engine loop of ``engine`` (an ``LLMEngine``), on its thread."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine
        self.seconds = dict.fromkeys(PHASES, 0.0)
        self.steps = 0
        self._stack: list[str] = []
        self._mark: float | None = None  # the last moment charged
        self._restore: list[Callable[[], None]] = []

    def _charge(self, now: float) -> None:
        if self._mark is not None:
            self.seconds[self._stack[-1] if self._stack else "between"] += now - self._mark
        self._mark = now

    def _wrap(self, owner: Any, name: str, phase: str, counts: bool = False) -> None:
        """Replace ``owner.name`` (an instance's or a class's attribute) by a timed call of it (``counts``:
        each call is a step)."""
        had_own = name in vars(owner)
        original = vars(owner)[name] if had_own else getattr(owner, name)  # a class's function, or bound

        def timed(*args: Any, **kwargs: Any) -> Any:
            self.steps += counts
            self._charge(time.perf_counter())
            self._stack.append(phase)
            try:
                return original(*args, **kwargs)
            finally:
                self._charge(time.perf_counter())
                self._stack.pop()

        setattr(owner, name, timed)
        self._restore.append(lambda: setattr(owner, name, original) if had_own else delattr(owner, name))

    def __enter__(self) -> "LoopTimer":
        from vtcore.worker.model_runner import StepHandle

        engine = self.engine
        self._wrap(engine, "step", "apply_outputs", counts=True)
        for owner, name, phase in ((engine.scheduler, "schedule", "schedule"), (engine.runner, "submit", "submit"),
                                   (StepHandle, "result", "wait"), (StepHandle, "draw_late", "late_draw")):
            self._wrap(owner, name, phase)
        return self

    def __exit__(self, *exc: Any) -> None:
        for restore in reversed(self._restore):
            restore()
        self._restore.clear()  # a call the engine thread is inside still finishes through its wrapper

    def summary(self) -> dict[str, Any]:
        """``{"steps": n, "ms_per_step": {phase: ms}}`` (each phase's total over the steps taken)."""
        per = {p: (s / self.steps * 1e3 if self.steps else None) for p, s in self.seconds.items()}
        return {"steps": self.steps, "ms_per_step": per}
