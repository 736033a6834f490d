"""The memory roofline of one decode step, measured in the same run as the benchmark.

A decode step at concurrency ``c`` must at least move

* the model's parameter bytes: the sum of ``nbytes`` over the loaded model's parameters, each tensor
  counted once (tied parameters, such as a tied embedding / LM head, share storage and count once);
  routed experts count only the share a step of ``c`` sequences is expected to touch
  (``Experts.active_fraction``: ``1 - (1 - k/E)^c`` under uniform routing, so ``k/E`` at batch 1);
* the KV cache read for ``c`` sequences of ``input_len + output_len / 2`` tokens (the mean context
  over a request's decode): per token ``2 * kv_heads * head_dim * dtype size`` for every attention
  layer of the runner. Recurrent state of stateful (e.g. linear-attention) layers is not counted.

The device's copy bandwidth is measured: a ~256 MiB tensor copied on the device (after one untimed
warm-up copy), ``2 * nbytes`` (read + write) over the median wall time of several timed copies, each
bracketed by ``torch.cuda.synchronize`` on CUDA. ``roofline_ms = bytes / bandwidth``; the benchmark
reports ``TPOT / roofline`` (1.0 would be a decode step running at copy bandwidth).
"""
from __future__ import annotations

import statistics
import time
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch


DEFAULT_COPY_MIB = 256
COPY_REPEATS = 5


def parameter_bytes(model: torch.nn.Module, batch: int | None = None) -> int:
    """Sum of parameter ``nbytes``, a tensor shared by several names (tied weights) counted once.

    With ``batch``, the bytes a decode step of that many sequences reads: a module with
    ``active_fraction(batch)`` (routed experts) counts its own parameters times that fraction.
    """
    scale: dict[int, float] = {}
    if batch is not None:
        for m in model.modules():
            if hasattr(m, "active_fraction"):
                scale.update({id(p): m.active_fraction(batch) for p in m.parameters(recurse=False)})
    seen: set[tuple[Any, int, int]] = set()
    total = 0.0
    for p in model.parameters():  # already yields each Parameter object once
        key = (p.device, p.data_ptr(), p.nbytes)
        if p.nbytes and key in seen:  # distinct Parameter objects viewing the same memory
            continue
        seen.add(key)
        total += p.nbytes * scale.get(id(p), 1.0)
    return round(total)


def kv_bytes_per_token(attention_layers: list[Any], dtype: torch.dtype) -> int:
    """K and V bytes one token occupies across the attention layers (``2 * kv_heads * head_dim * size``)."""
    import torch

    size = torch.empty((), dtype=dtype).element_size()
    return sum(2 * a.num_kv_heads * a.head_dim * size for a in attention_layers)


def decode_step_bytes(param_bytes: int, kv_per_token: int, concurrency: int, input_len: int,
                      output_len: int) -> dict[str, int]:
    """Bytes one decode step moves at ``concurrency``: parameters + KV read over the mean context.

    The context is ``input_len + output_len / 2`` tokens; ``kv_per_token`` is even (a K and a V), so the
    product stays an exact integer.
    """
    kv = concurrency * (kv_per_token * input_len + (kv_per_token // 2) * output_len)
    return {"param_bytes": param_bytes, "kv_bytes": kv, "bytes": param_bytes + kv}


def measure_copy_bandwidth(device: torch.device | str, mib: int = DEFAULT_COPY_MIB,
                           repeats: int = COPY_REPEATS) -> dict[str, Any]:
    """Copy a ``mib`` MiB tensor on ``device``: bandwidth = 2 * nbytes / median(timed copies)."""
    import torch

    device = torch.device(device)
    cuda = device.type == "cuda"
    n = mib * 2**20
    src = torch.ones(n, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    times = []
    try:
        for i in range(repeats + 1):
            if cuda:
                torch.cuda.synchronize(device)
            t0 = time.perf_counter()
            dst.copy_(src)
            if cuda:
                torch.cuda.synchronize(device)
            dt = time.perf_counter() - t0
            if i:  # the first copy is an untimed warm-up (page faults, lazy init)
                times.append(dt)
    finally:
        del src, dst
        if cuda:
            torch.cuda.empty_cache()
    median = statistics.median(times)
    moved = 2 * n
    return {"device": str(device), "nbytes": n, "bytes_moved_per_copy": moved, "times_s": times,
            "median_s": median, "bandwidth_bytes_s": moved / median}


def roofline_for_run(step: dict[str, int], bandwidth_bytes_s: float, tpot_s: float | None) -> dict[str, Any]:
    """One concurrency's roofline: ``roofline_ms = bytes / bandwidth``, ``tpot_over_roofline``."""
    roof_s = step["bytes"] / bandwidth_bytes_s
    return {**step, "roofline_ms": roof_s * 1e3,
            "tpot_over_roofline": (tpot_s / roof_s) if tpot_s is not None else None}
