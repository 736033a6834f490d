"""vLLM's ``start_profile`` / ``stop_profile``: ``torch.profiler`` over the engine's steps, one trace a window.

The trace holds the host's operators on every thread (the engine loop, the CPU forward's worker, the sender) and, on
CUDA, the device's kernels and copies; a tensor-parallel engine profiles its rank 0 only. ``stop_profile`` writes
``vtcore-<pid>-<tag>-<n>.pt.trace.json.gz`` (``tag``: the engine's own) (Chrome trace format: Perfetto and
chrome://tracing read it) to ``profiler_config``'s ``torch_profiler_dir``.
"""
from __future__ import annotations

import itertools
import os
import threading
import uuid

import torch
from torch.profiler import ProfilerActivity, profile

from vtcore.config import ProfilerConfig
from vtcore.errors import ProfilerStateError


def _all_threads() -> dict[str, object]:
    """The option that records the host operators of threads other than the one starting the profiler (the
    CPU forward runs on a worker thread), where this torch has it."""
    try:
        from torch._C._profiler import _ExperimentalConfig
        return {"experimental_config": _ExperimentalConfig(profile_all_threads=True)}
    except (ImportError, TypeError):
        return {}


#: torch's profiler records one window at a time in a process (a second one started meanwhile crashes it)
_recording_lock = threading.Lock()
_recording: list["StepProfiler"] = []


class StepProfiler:
    """One profiling window at a time; see the module docstring."""

    def __init__(self, config: ProfilerConfig | None, device: torch.device) -> None:
        self.config = config
        self.device = device
        self._running: profile | None = None
        self._serial = itertools.count()
        self._tag = f"{os.getpid()}-{uuid.uuid4().hex[:8]}"  # (two engines of one process write apart)

    def start(self) -> None:
        if self.config is None:
            raise ProfilerStateError('start_profile: no profiler is configured; start the engine with profiler_config='
                               '{"profiler": "torch", "torch_profiler_dir": DIR} (vLLM\'s)')
        if self._running is not None:
            raise ProfilerStateError("start_profile: a profile is already recording; stop_profile first")
        with _recording_lock:
            if _recording:
                raise ProfilerStateError("start_profile: another engine of this process is recording a profile "
                                         "(torch records one at a time); stop_profile there first")
            activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if self.device.type == "cuda" else [])
            self._running = profile(activities=activities, **_all_threads())
            self._running.start()
            _recording.append(self)

    def stop(self) -> str:
        """End the window; returns the trace's path."""
        if self._running is None:
            raise ProfilerStateError("stop_profile: no profile is recording; start_profile first")
        running, self._running = self._running, None
        with _recording_lock:
            running.stop()
            _recording.remove(self)
        folder = self.config.torch_profiler_dir
        os.makedirs(folder, exist_ok=True)
        path = os.path.join(folder, f"vtcore-{self._tag}-{next(self._serial)}.pt.trace.json.gz")
        running.export_chrome_trace(path)
        return path
