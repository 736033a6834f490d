"""Tensor-parallel ranks for one engine: rank 0 is the engine's own runner, ranks 1.. are worker processes.

The scheduler, sampling and everything on the host stay with rank 0. Each step rank 0 prepares sends the
workers a ``StepMessage`` (its staged inputs and the metadata its forward needs) over a gloo control
group (the ranks' groups are process-group objects of their own, not torch.distributed's default group,
so one process may run several engines); every rank then runs the same forward on its share of the
model (``vtcore.layers.parallel``: the collectives inside it), rank 0 broadcasting the step's input ids
after its combine (so in-flight tokens come from rank 0's device mirror, and the workers need none), and
the same ``compute_logits`` calls (the logits are gathered on every rank). Only rank 0 samples. A worker
that dies ends the engine with a ``TensorParallelError`` naming its rank and exit code; ``shutdown``
stops and joins every worker, or, inside ``reused_workers()``, parks them for the next engine (a worker
process serves one engine after another: it is told each engine's rank, size and store over a pipe).
"""
from __future__ import annotations

import contextlib
import os
import pickle
import tempfile
import threading
import time
from datetime import timedelta
from multiprocessing.connection import Connection
from typing import Any, Iterator

import attrs
import torch
import torch.distributed as dist

from vtcore.errors import VtcoreError
from vtcore.worker.processes import pipe, start_child
from vtcore.worker.shared_memory_group import SLOT_BYTES, SharedMemoryGroup, shared_memory_group
from vtcore.worker.staging import Staged

#: how long a collective waits for a peer before it fails (a dead worker also fails it at once)
TIMEOUT_S = 120
#: a shared-memory control group's slot: a step message's bytes (larger ones go through gloo)
CONTROL_SLOT_BYTES = 1 << 20


class TensorParallelError(VtcoreError, RuntimeError):
    """A tensor-parallel worker died or could not start."""


@attrs.frozen
class StepMessage:
    """What a worker needs of a step rank 0 submitted (the fields ``ModelRunner.run_model`` reads, then
    which rows rank 0 computes logits of)."""

    staged: Staged
    num_seqs: int
    max_blocks: int
    max_query_len: int
    max_context_len: int
    state: Any
    stale: bool
    samples: bool
    plp_rows: list[tuple[int, int]]
    mtp_width: int | None = None  # rank 0 runs the MTP head after the step (``MTPDrafter.propose``) with this width


@attrs.frozen
class PaddedStep:
    """A padded step (``vtcore.worker.decode_graphs``), as every rank runs it: which of the runner's padded
    paths (its index in ``ModelRunner._padded``), the host side ``DecodeGraphs.prepare`` made, the staged
    sections, and the state copies before and after the forward."""

    graphs: int
    inputs: Any  # DecodeInputs
    staged: Staged
    restores: list[tuple[int, int]]
    saves: list[tuple[int, int]]
    mtp_width: int | None = None  # as ``StepMessage.mtp_width``


@attrs.frozen
class WorkerSetup:
    """How a worker builds its share: the model's build arguments and rank 0's resolved runner config."""

    model_path: str  # a checkpoint folder (rank 0 resolved a hub id); the worker reads its config.json
    dtype: torch.dtype
    max_model_len: int
    load_format: str
    seed: int
    runner_config: Any
    plugins: list[tuple[str, str]]  # rank 0's plugin entry points (``Plugins.entry_points``): the same families
    draft_model: str | None = None  # a draft model's checkpoint folder, drafting on the device (``model.mtp``)


@attrs.define
class _Worker:
    """A worker process and rank 0's end of its pipe (where it is told which engine to join next)."""

    process: Any  # multiprocessing.Process
    conn: Connection
    device_type: str
    fresh: bool = True  # not yet joined an engine (a death before then may be the main module's import)

    def stop(self) -> None:
        """End the process (a stop on its pipe, then termination if it lingers) and join it."""
        with contextlib.suppress(OSError, ValueError):
            self.conn.send(None)
        self.process.join(timeout=10)
        if self.process.is_alive():
            self.process.kill()
            self.process.join()
        self.conn.close()


#: workers parked between engines inside ``reused_workers()`` (None outside it: shutdown stops them)
_idle: list[_Worker] | None = None


@contextlib.contextmanager
def reused_workers() -> Iterator[None]:
    """Within it, an engine's shutdown parks its workers and the next engine takes them instead of starting
    new ones (the conformance gate builds dozens of engines); on exit every parked worker stops."""
    global _idle
    if _idle is not None:  # nested: the outer one owns the workers
        yield
        return
    _idle = []
    try:
        yield
    finally:
        parked, _idle = _idle, None
        for w in parked:
            w.stop()


def _take_worker(device_type: str) -> _Worker:
    """A parked live worker for ``device_type``, else a new process."""
    for w in list(_idle or ()):
        _idle.remove(w)
        if w.device_type == device_type and w.process.is_alive():
            return w
        w.stop()
    ours, theirs = pipe()
    process = start_child(worker_main, (theirs, device_type), "vtcore-tp-worker", daemon=True, preload=_SERVE_IMPORTS)
    theirs.close()
    return _Worker(process, ours, device_type)


class Peers:
    """Rank 0's side: the worker processes and the ranks' two process groups of their own (so several engines
    can run in one process): ``group`` for the model's collectives (gloo on CPU, NCCL on CUDA) and a gloo
    control group for the step messages."""

    def __init__(self, size: int, device: torch.device) -> None:
        self.size, self.device = size, device
        self._store = tempfile.NamedTemporaryFile(prefix="vtcore-tp-", delete=False).name
        os.unlink(self._store)  # the file store creates it
        self.broken: str | None = None  # why the ranks are out of step (a step failed on rank 0)
        self.workers: list[_Worker] = []
        try:
            for rank in range(1, size):
                self.workers.append(_take_worker(device.type))
                self.workers[-1].conn.send((rank, size, self._store))
            for rank, w in enumerate(self.workers, start=1):
                _joining(rank, w)
            self.group, self.control = _groups(0, size, self._store, device.type)
        except BaseException:  # the workers taken so far are stopped, the store removed
            for w in self.workers:
                w.stop()
            if os.path.exists(self._store):
                os.unlink(self._store)
            raise

    @property
    def processes(self) -> list[Any]:
        """The workers' processes, rank 1 first."""
        return [w.process for w in self.workers]

    def setup(self, setup: WorkerSetup) -> None:
        self._send(setup)

    def ready(self) -> None:
        """Wait until every worker has built its share (``TensorParallelError`` naming one that died)."""
        try:
            _barrier(self.control)
        except RuntimeError as exc:
            for p in self.processes:  # a worker that failed closes its connection as it exits: let it finish
                p.join(timeout=5)
            self.check()
            raise TensorParallelError(f"tensor parallelism: a worker did not get ready ({exc})") from exc

    def send(self, message: StepMessage | PaddedStep) -> None:
        self._send(message)

    def failed(self, exc: BaseException) -> None:
        """Rank 0's part of a step raised ``exc``: the workers may wait in a collective it never reaches, and
        rank 0 may already be sending them the next step, so they are killed now (rank 0's waits on them end at
        once) and the engine runs no more steps, each saying why."""
        if self.broken is None:
            self.broken = f"{type(exc).__name__}: {exc}"
            for p in self.processes:
                p.kill()

    def _send(self, obj: Any) -> None:
        self.check()
        try:
            _broadcast_object(self.control, obj)
        except RuntimeError as exc:
            self.check()
            raise TensorParallelError(f"tensor parallelism: sending a step to the workers failed ({exc})") from exc

    def check(self) -> None:
        """Raise ``TensorParallelError`` naming the first worker that is no longer running (or the failed step
        that ended them)."""
        if self.broken is not None:
            raise TensorParallelError(f"tensor parallelism: a step failed on rank 0 ({self.broken}), leaving the "
                                      "workers mid-step; the engine runs no more steps")
        for rank, p in enumerate(self.processes, start=1):
            if not p.is_alive():
                raise TensorParallelError(f"tensor-parallel worker rank {rank} (pid {p.pid}) died "
                                          f"(exit code {p.exitcode}); the engine cannot run its steps")

    def shutdown(self) -> None:
        """End the workers' part in this engine, then stop them (or park them inside ``reused_workers()``)."""
        alive = self.broken is None and all(p.is_alive() for p in self.processes)
        try:
            if alive:
                _broadcast_object(self.control, None)
        except RuntimeError:
            alive = False  # a dead peer: the others are stopped below
        _close(self.group, self.control)
        self.group = self.control = None
        for w in self.workers:
            if alive and _idle is not None:
                _idle.append(w)
            else:
                w.stop()
        self.workers = []
        if os.path.exists(self._store):
            os.unlink(self._store)


def _joining(rank: int, w: _Worker) -> None:
    """Wait for worker ``w``'s word that it joins as ``rank``; one that exits first is a ``TensorParallelError``
    at once, not a rendezvous that times out minutes later (for a new process, with the likely cause: a script
    that builds the engine outside a main guard)."""
    deadline = time.monotonic() + TIMEOUT_S
    while w.process.is_alive() or w.conn.poll(0):
        if w.conn.poll(0.05):
            try:
                w.conn.recv()
                w.fresh = False
                return
            except (EOFError, OSError):  # its end of the pipe closed: it is exiting
                w.process.join(timeout=5)
                break
        if time.monotonic() > deadline:
            raise TensorParallelError(f"tensor-parallel worker rank {rank} did not start within {TIMEOUT_S} s")
    code = w.process.exitcode
    hint = (". A worker is a new process that first imports the main module: a script that builds an engine "
            "at its top level must do so under `if __name__ == \"__main__\":` (its error, if any, is above)"
            if w.fresh else "")
    raise TensorParallelError(f"tensor-parallel worker rank {rank} (pid {w.process.pid}) exited "
                              f"{'(its pipe closed)' if code is None else f'(exit code {code})'} before it could "
                              f"join the engine{hint}")


def _groups(rank: int, size: int, store_path: str, device_type: str) -> tuple[Any, Any]:
    """(the model's group, the control group) of this engine's ranks, over a file store. Host tensors' groups
    (the control group, and the model's on the CPU) of more than one rank go through shared memory, over gloo
    groups (which carry what is too large for it; a group of one rank stays gloo's)."""
    timeout = timedelta(seconds=TIMEOUT_S)
    store = dist.FileStore(store_path, size)

    def host_group(name: str, wait_s: float | None, slot_bytes: int) -> Any:
        gloo = dist.ProcessGroupGloo(dist.PrefixStore(name, store), rank, size, timeout)
        return gloo if size == 1 else shared_memory_group(rank, size, f"{store_path}.{name}", gloo, TIMEOUT_S,
                                                          wait_s, slot_bytes)

    # (a worker waits on the control group for rank 0's next step as long as the engine idles or rank 0 builds
    # its share: no bound there, a rank 0 that exits ends the wait; its messages are small, larger ones go by gloo)
    control = host_group("control", None, CONTROL_SLOT_BYTES)
    if device_type != "cuda":
        return host_group("model", TIMEOUT_S, SLOT_BYTES), control
    torch.cuda.set_device(rank)
    return dist.ProcessGroupNCCL(dist.PrefixStore("model", store), rank, size), control


def _close(*groups: Any) -> None:
    """Close the shared-memory groups among ``groups`` (torch's own end with their last reference)."""
    for group in groups:
        if isinstance(group, SharedMemoryGroup):
            group.close()


def _barrier(control: Any) -> None:
    """Every rank of ``control`` reached this point."""
    control.allreduce([torch.zeros(1)]).wait()


def _broadcast_object(control: Any, obj: Any) -> Any:
    """Rank 0's ``obj`` on every rank of ``control`` (pickled; the other ranks pass anything)."""
    payload = torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8) if obj is not _RECEIVE else None
    length = torch.tensor([0 if payload is None else payload.numel()], dtype=torch.int64)
    control.broadcast(length, 0).wait()
    if payload is None:
        payload = torch.empty(int(length.item()), dtype=torch.uint8)
    control.broadcast(payload, 0).wait()
    return pickle.loads(payload.numpy().tobytes())


_RECEIVE = object()  # a worker's side of _broadcast_object


def thread_lock_for_progress() -> None:
    """For a child process: tqdm's default lock is a multiprocessing semaphore, which a killed child (a worker
    after ``Peers.failed``, a dead engine core) leaves to the resource tracker, which warns at exit; the
    loaders' progress bars in a child need only a thread lock."""
    from tqdm import tqdm

    tqdm.set_lock(threading.RLock())


def worker_main(conn: Connection, device_type: str) -> None:
    """A worker process: serve one engine after another (its rank, size and store arrive on ``conn``; None
    ends the process). Of its torch threads as it starts (the cores, or ``OMP_NUM_THREADS`` as the fork server
    read it) a worker keeps one rank's share: the ranks compute at the same time, and on the CPU more threads
    than cores spin against each other. Rank 0, the caller's process, keeps its own setting."""
    thread_lock_for_progress()
    threads = torch.get_num_threads()
    while (job := conn.recv()) is not None:
        conn.send("joining")  # (rank 0 waits for it: ``_joining``)
        torch.set_num_threads(max(1, threads // job[1]))
        _serve(*job, device_type)


#: the modules ``_serve`` imports (they import this one), with all it imports: preloaded by the fork server
_SERVE_IMPORTS = ("vtcore.loading.model_loader", "vtcore.worker.model_runner")


def _serve(rank: int, size: int, store: str, device_type: str) -> None:
    """Join one engine's groups, build its share of the model and runner, follow rank 0's steps until it
    stops (a stop before the setup: rank 0 failed to build its own share)."""
    from vtcore.config import HFConfig
    from vtcore.layers.parallel import tensor_parallel
    from vtcore.loading.model_loader import build_model
    from vtcore.plugins.manager import plugins_from, use_plugins
    from vtcore.worker.model_runner import ModelRunner
    from vtcore.worker.mtp import build_draft_head

    group, control = _groups(rank, size, store, device_type)
    setup: WorkerSetup | None = _broadcast_object(control, _RECEIVE)
    if setup is None:
        _close(group, control)
        return
    device = torch.device(device_type, rank) if device_type == "cuda" else torch.device("cpu")
    with use_plugins(plugins_from(setup.plugins)), tensor_parallel(rank, size, group):
        model, family = build_model(setup.model_path, HFConfig.from_path(setup.model_path), device, setup.dtype,
                                    setup.max_model_len, setup.load_format, setup.seed,
                                    mtp=setup.runner_config.mtp and setup.draft_model is None)
        if setup.draft_model is not None:
            model.mtp = build_draft_head(setup.draft_model, device, setup.dtype, setup.max_model_len,
                                         setup.load_format, setup.seed)
        runner = ModelRunner(model, family, attrs.evolve(setup.runner_config, device=device, depth=1))
    _barrier(control)  # built: rank 0 waits for every worker (Peers.ready)
    runner.capture_graphs()  # with rank 0, which captures after every rank is ready
    while (message := _broadcast_object(control, _RECEIVE)) is not None:
        runner.follow(message)
    _close(group, control)
