"""The engine loop's phase timer of ``vtcore bench``: each moment of the engine thread goes to the
innermost phase running then, and the wrapped methods are put back."""
from __future__ import annotations

import pytest

from vtcore.bench import loop_timer
from vtcore.bench.loop_timer import PHASES, LoopTimer
from vtcore.worker.model_runner import StepHandle


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now

    def tick(self, ms: float) -> None:
        self.now += ms / 1e3


class Staging:
    def retire(self, index: int) -> None:
        pass


class Runner:
    staging = Staging()

    def __init__(self, clock: Clock) -> None:
        self.clock = clock

    def submit(self, batch: list) -> StepHandle:
        self.clock.tick(2)

        def wait():
            self.clock.tick(3)

        def late(force: bool):
            self.clock.tick(4)
            return wait  # the wait after the late draw
        return StepHandle(self, 0, 0, lambda: None, late)


class Scheduler:
    def __init__(self, clock: Clock) -> None:
        self.clock = clock

    def schedule(self) -> list:
        self.clock.tick(1)
        return [object()]


class Engine:
    def __init__(self, clock: Clock) -> None:
        self.clock, self.scheduler, self.runner = clock, Scheduler(clock), Runner(clock)

    def step(self) -> list:
        """Schedule (1 ms), submit (2), wait (3) with the late draw inside it (4), its own work (5)."""
        handle = self.runner.submit(self.scheduler.schedule())
        handle.result()
        self.clock.tick(5)
        return []


def test_each_moment_goes_to_the_innermost_phase(monkeypatch):
    clock = Clock()
    monkeypatch.setattr(loop_timer.time, "perf_counter", clock)
    engine = Engine(clock)
    with LoopTimer(engine) as timer:
        for _ in range(4):
            engine.step()
            clock.tick(6)  # the loop outside step
    summary = timer.summary()
    assert summary["steps"] == 4 and set(summary["ms_per_step"]) == set(PHASES)
    got = summary["ms_per_step"]
    want = {"schedule": 1, "submit": 2, "wait": 3, "late_draw": 4, "apply_outputs": 5, "between": 6 * 3 / 4}
    assert got == pytest.approx(want)  # the time before the first step and after the last is nobody's


def test_the_wrapped_methods_are_put_back(monkeypatch):
    engine = Engine(Clock())
    result, draw_late = StepHandle.result, StepHandle.draw_late
    with LoopTimer(engine):
        assert StepHandle.result is not result and "step" in vars(engine) and "schedule" in vars(engine.scheduler)
    assert StepHandle.result is result and StepHandle.draw_late is draw_late
    assert "step" not in vars(engine) and "schedule" not in vars(engine.scheduler)
    assert "submit" not in vars(engine.runner)
