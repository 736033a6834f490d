"""Per-decode-step statistics for ``vtcore bench``: host time, device time and kernel count.

* Host time: every ``ModelRunner.submit(batch)`` of the measured run is timed on the engine thread
  (:class:`StepTimer`) and tagged as a pure decode step when every scheduled sequence has
  ``num_tokens == 1`` (:func:`is_decode`).
* Device time and kernel count (CUDA only): after the measured run, a separate probe
  (:func:`probe_decode`) sends ``c`` fresh requests of the same prompt length; on the engine thread,
  once a pure decode step carries the full batch (``min(c, max_num_seqs)`` sequences) ``skip`` times,
  the device is synchronized, ``torch.profiler`` (CPU + CUDA activities) starts, ``steps`` full-batch
  decode steps are submitted, the device is synchronized again and the profiler stops. A step that is
  not a full-batch decode step closes the window early. The kernel events (kineto activity type
  ``kernel``; memcpy and memset are counted apart) are summed and divided by the window's steps
  (:func:`aggregate_device`); ``wall_ms_per_step`` is the window's wall time (sync to sync, profiler
  overhead included) per step. Kernels replayed from a CUDA graph are reported as kernel events by
  recent torch/CUPTI; when none are seen at all the counts are None with a reason, never 0.

* Triton compilations (:func:`count_triton_compiles`): the kernels Triton had to build (or load
  from its disk cache) while a concurrency was measured. Each is a stall of up to a second on the
  engine thread, so a non-empty list explains a TTFT outlier; the warm-up should leave it empty.

Nothing here imports torch at module import time.
"""
from __future__ import annotations

import asyncio
import contextlib
import random
import time
from typing import Any, Callable, Iterable, Iterator, Sequence

PROBE_SKIP, PROBE_STEPS, PROBE_SLACK = 3, 10, 16
KERNEL, MEMCPY, MEMSET = "kernel", "gpu_memcpy", "gpu_memset"
NO_CUDA = "no CUDA device"


def is_decode(batch: Sequence[Any]) -> bool:
    """A pure decode step: every scheduled sequence computes one token."""
    return bool(batch) and all(s.num_tokens == 1 for s in batch)


class StepTimer:
    """Through the runner's ``on_submit`` hook (while entered): per submit its host wall time and whether
    it decoded; ``window`` (a :class:`DecodeWindow`) sees every batch before and after its submit."""

    def __init__(self, runner: Any, window: "DecodeWindow | None" = None) -> None:
        self.runner, self.window = runner, window
        self.times: list[float] = []
        self.decode: list[bool] = []
        self._decode, self._t0 = False, 0.0

    @property
    def total(self) -> float:
        return sum(self.times)

    @property
    def calls(self) -> int:
        return len(self.times)

    def split(self) -> tuple[list[float], list[float]]:
        """(decode step host times, other step host times), seconds."""
        return ([t for t, d in zip(self.times, self.decode) if d],
                [t for t, d in zip(self.times, self.decode) if not d])

    def __enter__(self) -> "StepTimer":
        self.runner.on_submit.append(self._observe)
        return self

    def _observe(self, batch: Any, done: bool) -> None:
        """The runner's ``on_submit`` hook: called before a batch is prepared and after it is enqueued."""
        if not done:
            self._decode = is_decode(batch)
            if self.window is not None:
                self.window.before(batch, self._decode)
            self._t0 = time.perf_counter()
            return
        self.times.append(time.perf_counter() - self._t0)
        self.decode.append(self._decode)
        if self.window is not None:
            self.window.after()

    def __exit__(self, *exc: Any) -> None:
        self.runner.on_submit.remove(self._observe)


class DecodeWindow:
    """Profiles ``steps`` consecutive decode steps of ``batch_size`` sequences after skipping ``skip``.

    ``backend`` has ``sync()``, ``start()`` and ``stop() -> records``; every call happens on the thread
    that submits (the engine thread), as torch's profiler wants start and stop on one thread.
    """

    def __init__(self, skip: int, steps: int, batch_size: int, backend: Any) -> None:
        self.skip, self.want, self.batch_size, self.backend = skip, steps, batch_size, backend
        self.state = "wait"  # -> "open" -> "closed"
        self.skipped = self.steps = 0
        self.seqs = 0  # sequences over the window's steps
        self.wall_s: float | None = None
        self.records: list[tuple[str, str, float]] = []
        self.closed_by: str | None = None
        self._t0 = 0.0

    def before(self, batch: Sequence[Any], decode: bool) -> None:
        full = decode and len(batch) >= self.batch_size
        if self.state == "open" and not full:
            self._close("non-decode step" if not decode else f"batch shrank to {len(batch)}")
        if self.state == "wait" and full:
            if self.skipped < self.skip:
                self.skipped += 1
            else:
                self.backend.sync()
                self.backend.start()
                self._t0 = time.perf_counter()
                self.state = "open"
        if self.state == "open":
            self.steps += 1
            self.seqs += len(batch)

    def after(self) -> None:
        if self.state == "open" and self.steps >= self.want:
            self._close("full")

    def _close(self, why: str) -> None:
        self.backend.sync()
        self.wall_s = time.perf_counter() - self._t0
        self.records = list(self.backend.stop())
        self.state, self.closed_by = "closed", why


def event_kind(name: str, device_type: str, activity_type: str | None) -> str:
    """A kineto event's activity type; older torch without ``activity_type()``: guessed from the
    device type and the name kineto gives copies and fills."""
    if activity_type:
        return activity_type
    if device_type.upper() != "CUDA":
        return "cpu_op"
    return MEMCPY if name.startswith("Memcpy") else MEMSET if name.startswith("Memset") else KERNEL


def records_from_kineto(events: Iterable[Any]) -> list[tuple[str, str, float]]:
    """``(name, kind, duration_us)`` of each ``_KinetoEvent``."""
    out = []
    for e in events:
        dt = e.device_type()
        at = e.activity_type() if hasattr(e, "activity_type") else None
        dur = e.duration_ns() / 1e3 if hasattr(e, "duration_ns") else float(e.duration_us())
        out.append((e.name(), event_kind(e.name(), getattr(dt, "name", str(dt).rsplit(".", 1)[-1]), at), dur))
    return out


def is_collective(name: str) -> bool:
    """A tensor-parallel collective's kernel (NCCL's all-reduce, all-gather, broadcast)."""
    return name.startswith("nccl") or "AllReduce" in name or "AllGather" in name


def aggregate_device(records: Iterable[tuple[str, str, float]], steps: int, wall_s: float | None) -> dict[str, Any]:
    """Per decode step: kernels and their summed duration (ms), of it the collectives' (tensor parallelism),
    memcpy/memset counts (and memcpy ms) apart, and the window's wall ms. Counts are None with a ``reason``
    when no step, or no kernel, was seen."""
    n = {KERNEL: 0, MEMCPY: 0, MEMSET: 0}
    us = {KERNEL: 0.0, MEMCPY: 0.0, MEMSET: 0.0}
    collective_us = 0.0
    for name, kind, dur in records:
        if kind in n:
            n[kind] += 1
            us[kind] += dur
            collective_us += dur if kind == KERNEL and is_collective(name) else 0.0
    out: dict[str, Any] = {"steps": steps, "wall_ms_per_step": None, "device_ms_per_step": None,
                           "collective_ms_per_step": None, "kernels_per_step": None, "memcpy_per_step": None,
                           "memcpy_ms_per_step": None, "memset_per_step": None, "reason": None}
    if steps <= 0:
        return {**out, "reason": "no full-batch decode step was profiled"}
    out.update(wall_ms_per_step=None if wall_s is None else wall_s / steps * 1e3,
               memcpy_per_step=n[MEMCPY] / steps, memcpy_ms_per_step=us[MEMCPY] / steps / 1e3,
               memset_per_step=n[MEMSET] / steps)
    if n[KERNEL] == 0:
        out["reason"] = (f"the profiler saw no kernel events in {steps} decode steps (kernels replayed from a "
                         f"CUDA graph are not traced by this torch/CUPTI?)")
    else:
        out.update(kernels_per_step=n[KERNEL] / steps, device_ms_per_step=us[KERNEL] / steps / 1e3,
                   collective_ms_per_step=collective_us / steps / 1e3)
    return out


def unavailable(reason: str) -> dict[str, Any]:
    """The device section when nothing was profiled (CPU: ``"no CUDA device"``)."""
    return {**aggregate_device([], 0, None), "reason": reason, "profiled": False}


def init_profiler_on_this_thread() -> None:
    """Start and stop an empty CPU + CUDA profile here, on the thread that imported torch.

    Kineto runs its client's init callback only on the thread that registered the client (torch's
    import); the first profile started on another thread (the engine thread, where the decode window
    opens) prints "ERROR: External init callback must run in same thread as registerClient" and skips
    that init. Done once here first, later profiles on any thread find it done."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]):
        pass


class TorchProfiler:
    """The :class:`DecodeWindow` backend: ``torch.profiler`` over ``activities`` (default CPU + CUDA)."""

    def __init__(self, device: Any, activities: Sequence[str] = ("cpu", "cuda")) -> None:
        self.device, self.activities, self.prof = device, tuple(activities), None
        self.name = "torch.profiler " + "+".join(a.upper() for a in self.activities)

    def sync(self) -> None:
        if getattr(self.device, "type", None) == "cuda":
            import torch
            torch.cuda.synchronize(self.device)

    def start(self) -> None:
        from torch.profiler import ProfilerActivity, profile
        self.prof = profile(activities=[getattr(ProfilerActivity, a.upper()) for a in self.activities])
        self.prof.start()

    def stop(self) -> list[tuple[str, str, float]]:
        self.prof.stop()
        return records_from_kineto(self.prof.profiler.kineto_results.events())


async def probe_decode(engine: Any, c: int, input_len: int, output_len: int, rng: random.Random,
                       skip: int = PROBE_SKIP, steps: int = PROBE_STEPS,
                       backend_factory: Callable[[Any], Any] = TorchProfiler) -> dict[str, Any]:
    """Send ``c`` requests through ``engine`` (an ``AsyncLLM``) and profile a window of their decode steps."""
    from vtcore.sampling_params import SamplingParams

    inner = engine.engine
    backend = backend_factory(inner.device)
    batch = min(c, inner.scheduler.max_num_seqs)
    window = DecodeWindow(skip, steps, batch, backend)
    params = SamplingParams(temperature=0.0, max_tokens=min(output_len, skip + steps + PROBE_SLACK),
                            ignore_eos=True)

    async def one(rid: str, ids: list[int], p: Any) -> None:
        async for _ in engine.generate({"prompt_token_ids": ids}, p, request_id=rid):
            pass

    with StepTimer(inner.runner, window):
        await asyncio.gather(*(one(f"bench-probe-c{c}-{i}", [rng.randrange(inner.vocab_size)
                                                             for _ in range(input_len)], params)
                               for i in range(c)))
        if window.state == "open":  # the window outlived the probe: a 2-token prefill closes it on the engine thread
            await one(f"bench-probe-c{c}-close", [0, 0], SamplingParams(temperature=0.0, max_tokens=1))
    return {**aggregate_device(window.records, window.steps, window.wall_s), "profiled": window.steps > 0,
            "profiler": backend.name, "batch_size": batch,
            "mean_batch_size": window.seqs / window.steps if window.steps else None,
            "skip_steps": skip, "requested_steps": steps, "closed_by": window.closed_by,
            "max_tokens": params.max_tokens}


@contextlib.contextmanager
def count_triton_compiles() -> Iterator[list[str]]:
    """Collects the name of every Triton kernel variant compiled (or loaded from disk) inside the block,
    from any thread, through Triton's ``jit_cache_hook``; an empty list when Triton is absent."""
    from vtcore.engine.compile_watch import on_triton_compile

    names: list[str] = []
    restore = on_triton_compile(lambda name, spec: names.append(name))
    try:
        yield names
    finally:
        restore()
