"""Host staging: the pinned buffers a step's int inputs are packed into before one upload.

Each in-flight step owns one of ``depth`` buffers; a buffer is refilled only after the step that used
it has retired (its result was taken), so preparing step N+1 never rewrites memory that step N's
non-blocking upload may still read.
"""
from __future__ import annotations

import ctypes
import struct
from typing import Any, Sequence

import attrs
import torch

_FORMATS = {torch.int64: "q", torch.int32: "i", torch.float32: "f"}


def host_tensor(data: Sequence[int | float], dtype: torch.dtype) -> torch.Tensor:
    """A CPU tensor of a list of Python numbers, packed by ``struct`` for the step's usual dtypes (int64,
    int32, float32): ``torch.tensor`` of a list infers each item's type, several times slower, and a step's
    inputs are on the host's path before the device may start (docs/BENCHMARKS.md). A float in an int list
    raises ``struct.error`` where ``torch.tensor`` would truncate it."""
    fmt = _FORMATS.get(dtype)
    if fmt is None or len(data) == 0:
        return torch.tensor(data, dtype=dtype)
    return torch.frombuffer(bytearray(struct.pack(f"{len(data)}{fmt}", *data)), dtype=dtype)


@attrs.define
class Staged:
    """One step's packed inputs: its buffer index, the host slice and each section's bounds in it."""

    index: int
    host: torch.Tensor
    bounds: list[tuple[int, int]]

    def __getstate__(self) -> dict:
        """Pickled (a tensor-parallel step message) with a copy of the slice: a view pickles its whole storage,
        the staging buffer that grew to the largest step so far."""
        return {"index": self.index, "host": self.host.clone(), "bounds": self.bounds}

    def __setstate__(self, state: dict) -> None:
        for name, value in state.items():
            object.__setattr__(self, name, value)


class Staging:
    def __init__(self, depth: int, device: torch.device) -> None:
        self.depth, self.device = depth, device
        self.pinned = device.type == "cuda"
        self._buffers = [torch.empty(0, dtype=torch.int64) for _ in range(depth)]
        self._bytes: list[Any] = [None] * depth  # each buffer's memory as a writable memoryview of bytes (``stage``)
        self._tokens = [torch.empty(0, dtype=torch.int64) for _ in range(depth)]
        self._owner: list[int | None] = [None] * depth

    def stage(self, step: int, sections: list[list[int] | memoryview], align: int = 2) -> Staged:
        """Pack int sections (lists of ints, or buffers of native int64s as memoryviews of format ``q``: copied
        whole) into step ``step``'s buffer.

        Each section starts at a multiple of ``align`` int64s, 16 bytes by default: Triton specialises
        a kernel on its pointers' alignment, so a view at an odd offset would compile another variant
        mid-run (a ~1 s stall). The padded decode path packs densely (``align=1``): its layout is
        the one its graphs captured."""
        index = step % self.depth
        owner = self._owner[index]
        if owner is not None:
            raise RuntimeError(f"staging buffer {index} is still owned by step {owner}: "
                               f"more than depth={self.depth} steps in flight")
        bounds = []
        n = 0
        for s in sections:
            bounds.append((n, n + len(s)))
            n += len(s) + (-(n + len(s)) % align)
        host = self._buffers[index]
        if host.numel() < n or self._bytes[index] is None:
            host = torch.zeros(max(n, 2 * host.numel(), 1), dtype=torch.int64, pin_memory=self.pinned)
            self._buffers[index] = host
            memory = (ctypes.c_char * (host.numel() * 8)).from_address(host.data_ptr())
            self._bytes[index] = memoryview(memory).cast("B")
        memory, at = self._bytes[index], host.data_ptr()
        for s, (a, b), end in zip(sections, bounds, [a for a, _ in bounds[1:]] + [n]):
            if b > a and isinstance(s, memoryview):
                memory[8 * a:8 * b] = s.cast("B")
            elif b > a:  # packed straight into the buffer (no list of every section's ints first)
                struct.pack_into(f"{b - a}q", memory, 8 * a, *s)
            if end > b:  # the alignment's padding: zeros
                ctypes.memset(at + 8 * b, 0, 8 * (end - b))
        self._owner[index] = step
        return Staged(index, host[:n], bounds)

    def upload(self, staged: Staged, dest: torch.Tensor | None = None, into: int | None = None) -> list[torch.Tensor]:
        """Device views of the staged sections: one non-blocking copy on CUDA, into ``dest`` (a
        persistent buffer) when given, else into a new tensor (on CPU without ``dest``: the host views).
        With ``into``, only the first ``into`` sections go to ``dest``, the rest to a new tensor."""
        host = staged.host
        if dest is None:
            dev = host.to(self.device, non_blocking=True) if self.pinned else host
            return [dev[a:b] for a, b in staged.bounds]
        cut = staged.bounds[into][0] if into is not None and into < len(staged.bounds) else host.numel()
        head = dest[:cut].copy_(host[:cut], non_blocking=True)
        tail = host[cut:].to(self.device, non_blocking=True) if self.pinned else host[cut:]
        return [head[a:b] if b <= cut else tail[a - cut:b - cut] for a, b in staged.bounds]

    def host_tokens(self, index: int, n: int) -> torch.Tensor:
        """Host int64 [n] (pinned on CUDA) that buffer ``index``'s step copies its sampled tokens into: reused
        by the next step that takes the buffer, which only a retired step lets happen."""
        host = self._tokens[index]
        if host.numel() < n:
            with torch.inference_mode(False):  # (a normal tensor: written in inference mode and out of it)
                host = torch.empty(max(n, 2 * host.numel()), dtype=torch.int64, pin_memory=self.pinned)
            self._tokens[index] = host
        return host[:n]

    def retire(self, index: int) -> None:
        """The step using buffer ``index`` is done with it."""
        self._owner[index] = None

    def release(self, step: int) -> None:
        """Step ``step`` failed before it was enqueued: it holds no buffer."""
        self._owner = [None if owner == step else owner for owner in self._owner]

    def buffer(self, index: int) -> torch.Tensor:
        return self._buffers[index]
