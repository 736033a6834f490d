"""Arrival counters for kernels whose last-finishing program reduces the others' partials.

Split-K GEMV, split-KV decode attention and the fused MoE write float32 partials; instead of a second
launch to combine them, every program of a group bumps the group's counter after its partial is stored,
and the program that sees ``arrivals - 1`` (the last one) sums the partials in index order (so results
stay deterministic) and resets the counter to zero. Every kernel thus leaves the counters all zero,
which is what lets all kernels on a device share one buffer: launches on a stream run one after the
other. Two streams of one device must therefore not run these kernels at once (the engine
runs all device work on one stream; graph replays go on it too).

The buffer is allocated zeroed on first use, outside any CUDA graph capture (the runner's warm-up
forward runs before it captures), and grows only eagerly.
"""
from __future__ import annotations

import torch

__all__ = ["arrival_counters"]

_MIN_COUNTERS = 1 << 16
_counters: dict[torch.device, torch.Tensor] = {}


def arrival_counters(device: torch.device, n: int) -> torch.Tensor:
    """A zeroed int32 buffer of at least ``n`` counters on ``device``, shared by every kernel there."""
    buf = _counters.get(device)
    if buf is None or buf.numel() < n:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise RuntimeError(f"arrival_counters: {n} counters needed during CUDA graph capture but only "
                               f"{0 if buf is None else buf.numel()} exist; run the shape eagerly first")
        buf = torch.zeros(max(n, _MIN_COUNTERS), dtype=torch.int32, device=device)
        _counters[device] = buf
    return buf
