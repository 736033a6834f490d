"""Device facts the launch heuristics read (host ints only, cached: no sync, graph-safe)."""
from __future__ import annotations

import functools

import torch

__all__ = ["num_sms"]

INTERPRET_SMS = 132  # the H200's, so the interpreter (CPU tensors) runs the same heuristics


@functools.cache
def num_sms(device: torch.device) -> int:
    """Streaming multiprocessors of ``device`` (``INTERPRET_SMS`` for a CPU device)."""
    if device.type != "cuda":
        return INTERPRET_SMS
    return torch.cuda.get_device_properties(device).multi_processor_count
