"""Host microseconds of the small CUDA operations a step's host path makes, each alone (medians of 2,000
calls; docs/BENCHMARKS.md): event creation and record, pinned copies to the host, small uploads, a gather,
the masked-argmax launch. Beside ``scripts/engine_call_costs.py`` (the same calls inside the engine) it
shows what the engine's waits for the GIL add.

    python3 scripts/host_op_costs.py   (on a CUDA machine)
"""
from __future__ import annotations

import itertools
import statistics
import time
from typing import Callable

import torch

from vtcore.kernels.masked_argmax import masked_argmax
from vtcore.worker.sampler import to_device
from vtcore.worker.staging import host_tensor

DEVICE = torch.device("cuda")
ROWS = 32  # a step's sampling rows
LATE = list(range(0, ROWS, 2))  # half of them late (constrained)
VOCAB, WORDS = 151936, 64


def median_us(fn: Callable[[], object], calls: int = 2000) -> float:
    for _ in range(50):
        fn()
    torch.cuda.synchronize()
    times = []
    for i in range(calls):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
        if i % 200 == 199:  # (the queue never fills)
            torch.cuda.synchronize()
    torch.cuda.synchronize()
    return statistics.median(times) * 1e6


def main() -> None:
    if not torch.cuda.is_available():
        raise SystemExit("host_op_costs.py times CUDA operations: no CUDA device here")
    tokens = torch.zeros(ROWS, dtype=torch.int64, device=DEVICE)
    events = itertools.cycle([torch.cuda.Event() for _ in range(8)])
    pinned_rows = itertools.cycle([torch.empty(ROWS, dtype=torch.int64).pin_memory() for _ in range(8)])
    mask = torch.zeros(len(LATE), WORDS, dtype=torch.int32).pin_memory()
    logits = torch.randn(ROWS, VOCAB, device=DEVICE)
    late = torch.tensor(LATE, device=DEVICE)
    late_logits, words = logits[late], mask.to(DEVICE)
    mirror = torch.zeros(2 * ROWS, dtype=torch.int64, device=DEVICE)
    cases: dict[str, Callable[[], object]] = {
        "torch.cuda.Event() + record": lambda: torch.cuda.Event().record(),
        "an event of a ring: record": lambda: next(events).record(),
        "tokens to host: empty(pin_memory) + copy_": lambda: torch.empty(
            ROWS, dtype=torch.int64, pin_memory=True).copy_(tokens, non_blocking=True),
        "tokens to host: a pinned row of a ring, copy_": lambda: next(pinned_rows).copy_(tokens, non_blocking=True),
        "to_device(16 ints): pack, pin, upload": lambda: to_device(LATE, torch.int64, DEVICE),
        "host_tensor(16 ints)": lambda: host_tensor(LATE, torch.int64),
        "pinned mask: to_device (pin check + upload)": lambda: to_device(mask, torch.int32, DEVICE),
        "pinned mask: .to(device) alone": lambda: mask.to(DEVICE, non_blocking=True),
        "logits[rows] (16 of 32 rows)": lambda: logits[late],
        "masked_argmax, 16 rows, two into writes": lambda: masked_argmax(late_logits, words,
                                                                         ((mirror, late), (tokens, late))),
        "torch.empty(16) on the device": lambda: torch.empty(len(LATE), dtype=torch.int64, device=DEVICE),
    }
    print(torch.cuda.get_device_name())
    for name, fn in cases.items():
        print(f"{name:50s} {median_us(fn):8.1f} us")


if __name__ == "__main__":
    main()
