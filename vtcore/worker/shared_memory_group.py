"""``SharedMemoryGroup``: the CPU collectives of one host's tensor-parallel ranks through shared memory.

The ranks' tensors pass through one memory-mapped file, and each collective ends with every rank sending each
peer one byte over a Unix socket and reading one byte from each: the wake-up a collective needs, without
gloo's transport, whose collective took 1.5-1.9 ms on a 2-core machine where a socket's round trip takes
15 us (docs/BENCHMARKS.md). It answers the calls ``vtcore.layers.parallel`` and ``vtcore.worker.tensor_parallel``
make of a c10d process group (``allreduce([t])``, ``allgather([parts], [t])``, ``broadcast(t, root)``, each
returning work to ``wait()`` on), and hands a tensor larger than its slots to the gloo group it wraps (every rank
decides alike: the ranks' tensors have the same size).

Two sets of slots are used in turn: a rank writes collective k + 2's tensor into collective k's slots only after
collective k + 1's bytes came from every peer, and each peer sent those only once it had read collective k's
slots. A peer that exits closes its sockets, so a rank waiting on it fails at once with a ``RuntimeError``, as
a gloo collective does; a peer that hangs fails it after the timeout.
"""
from __future__ import annotations

import mmap
import os
import socket
from typing import Any

import torch

#: bytes of one rank's slot (two sets of one slot a rank): larger tensors go through the wrapped group
SLOT_BYTES = 4 << 20
_ALIGN = 64
#: the longest Unix socket path every platform binds (Linux takes 107 bytes, macOS 103)
_MAX_SOCKET_PATH = 100
#: slot views kept (one a set, rank, dtype and shape; a step's shapes repeat)
_MAX_VIEWS = 4096


class _Done:
    """A collective's work, already complete (c10d's ``Work.wait`` returns True)."""

    @staticmethod
    def wait(*args: Any) -> bool:
        return True


_DONE = _Done()


class SharedMemoryGroup:
    """Collectives of ``size`` ranks over ``data`` (the shared file's map) and ``peers`` (a connected socket to
    each other rank, by rank); ``fallback``: the group that carries tensors over ``slot_bytes``."""

    def __init__(self, rank: int, size: int, data: mmap.mmap, peers: dict[int, socket.socket], fallback: Any,
                 slot_bytes: int = SLOT_BYTES) -> None:
        self.rank, self.size, self.fallback, self.slot_bytes = rank, size, fallback, slot_bytes
        self._map, self.peers = data, peers
        with torch.inference_mode(False):
            self._bytes: torch.Tensor | None = torch.frombuffer(data, dtype=torch.uint8)
        self._turn = 0  # which set of slots the next collective uses
        self._views: dict[tuple[Any, ...], torch.Tensor] = {}
        self._broken: RuntimeError | None = None

    def _slot(self, rank: int, like: torch.Tensor) -> torch.Tensor:
        """Rank ``rank``'s slot of this collective's set, as a tensor of ``like``'s dtype and shape (views are
        kept: making one costs more than a small collective's copies)."""
        key = (self._turn, rank, like.dtype, like.shape)
        view = self._views.get(key)
        if view is None:
            if len(self._views) >= _MAX_VIEWS:
                self._views.clear()
            start = (self._turn * self.size + rank) * self.slot_bytes
            with torch.inference_mode(False):  # (a view made in inference mode takes no in-place write outside it)
                view = self._bytes[start:start + like.numel() * like.element_size()].view(like.dtype).view(like.shape)
            self._views[key] = view
        return view

    def _shared(self, t: torch.Tensor) -> bool:
        """Whether ``t`` goes through the slots (else through the fallback); a group out of step or closed
        fails every collective."""
        if self._broken is not None:
            raise self._broken
        return t.device.type == "cpu" and t.numel() * t.element_size() <= self.slot_bytes

    def _exchange(self) -> None:
        """Every rank's slot is written: tell each peer, and wait for each peer's word. A failure leaves the group
        out of step (a word may be sent, a slot half read): every later collective fails with the same error."""
        try:
            self._words()
        except RuntimeError as exc:
            self._broken = exc
            raise

    def _words(self) -> None:
        for rank, peer in self.peers.items():
            try:
                peer.sendall(b"\0")
            except OSError:  # (a closed connection: its rank exited)
                raise self._gone(rank) from None
        for rank, peer in self.peers.items():
            try:
                got = peer.recv(1)
            except ConnectionError:
                raise self._gone(rank) from None
            except OSError as exc:  # (socket.timeout too)
                raise RuntimeError(f"shared-memory collective: rank {rank} did not answer rank {self.rank} "
                                   f"({exc or type(exc).__name__})") from None
            if not got:
                raise self._gone(rank)

    def _gone(self, rank: int) -> RuntimeError:
        return RuntimeError(f"shared-memory collective: rank {rank} closed its connection to rank {self.rank} "
                            "(it exited)")

    def _done(self) -> _Done:
        self._turn ^= 1
        return _DONE

    def allreduce(self, tensors: list[torch.Tensor]) -> Any:
        """``tensors[0]`` summed over the ranks, in place; the sum is taken in rank order on every rank, so every
        rank holds the same bits."""
        (x,) = tensors
        if not self._shared(x):
            return self.fallback.allreduce(tensors)
        self._slot(self.rank, x).copy_(x)
        self._exchange()
        x.copy_(self._slot(0, x))
        for rank in range(1, self.size):
            x.add_(self._slot(rank, x))
        return self._done()

    def allgather(self, outputs: list[list[torch.Tensor]], inputs: list[torch.Tensor]) -> Any:
        """``outputs[0][r]`` = rank r's ``inputs[0]``."""
        (x,) = inputs
        if not self._shared(x):
            return self.fallback.allgather(outputs, inputs)
        self._slot(self.rank, x).copy_(x)
        self._exchange()
        for rank, part in enumerate(outputs[0]):
            part.copy_(self._slot(rank, x))
        return self._done()

    def broadcast(self, x: torch.Tensor, root: int) -> Any:
        """Rank ``root``'s ``x`` on every rank, in place."""
        if not self._shared(x):
            return self.fallback.broadcast(x, root)
        if self.rank == root:
            self._slot(root, x).copy_(x)
        self._exchange()
        if self.rank != root:
            x.copy_(self._slot(root, x))
        return self._done()

    def close(self) -> None:
        """Close the sockets and the map (a peer still waiting on this rank then fails at once); again: nothing."""
        if self._bytes is None:
            return
        self._broken = RuntimeError(f"shared-memory collective: rank {self.rank}'s group is closed")
        for peer in self.peers.values():
            peer.close()
        self.peers = {}
        self._views.clear()
        self._bytes = None
        try:
            self._map.close()
        except BufferError:  # a collective on another thread still holds a slot: the map ends with its last view
            pass


def _data_paths(prefix: str) -> list[str]:
    """Where the shared file may go, best first: tmpfs (``/dev/shm``), then beside ``prefix``."""
    return [os.path.join("/dev/shm", os.path.basename(prefix) + ".shm"), f"{prefix}.shm"]


def _make_data(prefix: str, nbytes: int) -> int:
    """Rank 0: the shared file of ``nbytes``, its space reserved (a full disk fails here, not as a SIGBUS at a
    write to the map); the index of its path in ``_data_paths``, or -1 where none could be made."""
    for i, path in enumerate(_data_paths(prefix)):
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        except OSError:
            continue
        try:
            os.posix_fallocate(fd, 0, nbytes)
            return i
        except OSError:
            os.unlink(path)
        finally:
            os.close(fd)
    return -1


def shared_memory_group(rank: int, size: int, prefix: str, fallback: Any, timeout_s: float,
                        wait_s: float | None = None, slot_bytes: int = SLOT_BYTES) -> Any:
    """Every rank's ``SharedMemoryGroup`` of the ranks ``fallback`` (a CPU process group of ``size`` ranks)
    joins, made through it, with its files named after ``prefix`` (unique to the group; removed before this
    returns, also when it fails); the ``fallback`` itself where the shared file cannot be made (rank 0 decides
    for every rank). ``timeout_s`` bounds the joining; ``wait_s`` each collective's wait for a peer that is
    alive (None: no bound; a peer that exits fails it at once)."""
    if slot_bytes <= 0 or slot_bytes % _ALIGN:
        raise ValueError(f"slot_bytes={slot_bytes}: expected a positive multiple of {_ALIGN} (a slot holds any dtype)")
    nbytes = 2 * size * slot_bytes
    longest = f"{prefix}.{size - 1}.sock"  # (every rank judges by the same name: all take the shared path, or none)
    if not hasattr(socket, "AF_UNIX") or not hasattr(os, "posix_fallocate") or len(longest) > _MAX_SOCKET_PATH:
        return fallback
    address = f"{prefix}.{rank}.sock"
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    bound, made, data, peers = False, -1, None, {}
    try:
        listener.bind(address)
        bound = True
        listener.listen(size)
        if rank == 0:
            made = _make_data(prefix, nbytes)
        # rank 0's answer (the path's index + 1; 0: none) to every rank, by a sum: an all-reduce, unlike a
        # broadcast, ends only once every rank is in it, so every listener is bound before any rank connects
        where = torch.tensor([made + 1 if rank == 0 else 0], dtype=torch.int64)
        fallback.allreduce([where]).wait()
        if where.item() == 0:
            return fallback
        fd = os.open(_data_paths(prefix)[int(where.item()) - 1], os.O_RDWR)
        try:
            data = mmap.mmap(fd, nbytes)
        finally:
            os.close(fd)
        for lower in range(rank):
            peers[lower] = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            peers[lower].connect(f"{prefix}.{lower}.sock")
            peers[lower].sendall(bytes([rank]))
        listener.settimeout(timeout_s)
        for _ in range(rank + 1, size):
            conn, _ = listener.accept()
            higher = conn.recv(1)
            if not higher:
                conn.close()
                raise RuntimeError(f"shared-memory group: a rank closed its connection to rank {rank} as it joined")
            peers[higher[0]] = conn
        for peer in peers.values():
            peer.settimeout(wait_s)
        fallback.allreduce([torch.zeros(1)]).wait()  # every rank holds the map and its sockets: the names can go
        group = SharedMemoryGroup(rank, size, data, dict(sorted(peers.items())), fallback, slot_bytes)
    except BaseException:
        for peer in peers.values():
            peer.close()
        if data is not None:
            data.close()
        raise
    finally:
        listener.close()
        if bound:
            os.unlink(address)
        if made >= 0:
            os.unlink(_data_paths(prefix)[made])
    return group
