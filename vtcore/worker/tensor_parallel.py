"""Tensor-parallel ranks for one engine: rank 0 is the engine's own runner, ranks 1.. are worker processes.

The scheduler, sampling and everything on the host stay with rank 0. Each step rank 0 prepares sends the
workers a ``StepMessage`` (its staged inputs and the metadata its forward needs) over a gloo control
group (the ranks' groups are process-group objects of their own, not torch.distributed's default group,
so one process may run several engines); every rank then runs the same forward on its share of the
model (``vtcore.layers.parallel``: the collectives inside it), rank 0 broadcasting the step's input ids
after its combine (so in-flight tokens come from rank 0's device mirror, and the workers need none), and
the same ``compute_logits`` calls (the logits are gathered on every rank). Only rank 0 samples. A worker
that dies ends the engine with a ``TensorParallelError`` naming its rank and exit code; ``shutdown``
stops and joins every worker.
"""
from __future__ import annotations

import multiprocessing
import os
import pickle
import tempfile
from datetime import timedelta
from typing import Any

import attrs
import torch
import torch.distributed as dist

from vtcore.errors import VtcoreError
from vtcore.worker.staging import Staged

#: how long a collective waits for a peer before it fails (a dead worker also fails it at once)
TIMEOUT_S = 120


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


@attrs.frozen
class WorkerSetup:
    """How a worker builds its share: the model's build arguments and rank 0's resolved runner config."""

    model_path: str  # a checkpoint folder (rank 0 resolved a hub id); the worker reads its config.json
    dtype: torch.dtype
    max_model_len: int
    load_format: str
    seed: int
    runner_config: Any


class Peers:
    """Rank 0's side: the worker processes and the ranks' two process groups of their own (so several engines
    can run in one process): ``group`` for the model's collectives (gloo on CPU, NCCL on CUDA) and a gloo
    control group for the step messages."""

    def __init__(self, size: int, device: torch.device) -> None:
        self.size, self.device = size, device
        self._store = tempfile.NamedTemporaryFile(prefix="vtcore-tp-", delete=False).name
        os.unlink(self._store)  # the file store creates it
        context = multiprocessing.get_context("spawn")
        self.processes = [context.Process(target=worker_main, args=(rank, size, self._store, device.type),
                                          name=f"vtcore-tp-rank{rank}", daemon=True) for rank in range(1, size)]
        for p in self.processes:
            p.start()
        self.group, self.control = _groups(0, size, self._store, device.type)

    def setup(self, setup: WorkerSetup) -> None:
        self._send(setup)

    def send(self, message: StepMessage) -> None:
        self._send(message)

    def _send(self, obj: Any) -> None:
        self.check()
        try:
            _broadcast_object(self.control, obj)
        except RuntimeError as exc:
            self.check()
            raise TensorParallelError(f"tensor parallelism: sending a step to the workers failed ({exc})") from exc

    def check(self) -> None:
        """Raise ``TensorParallelError`` naming the first worker that is no longer running."""
        for rank, p in enumerate(self.processes, start=1):
            if not p.is_alive():
                raise TensorParallelError(f"tensor-parallel worker rank {rank} (pid {p.pid}) died "
                                          f"(exit code {p.exitcode}); the engine cannot run its steps")

    def shutdown(self) -> None:
        """Stop the workers (a stop message, then termination of any that lingers)."""
        try:
            if all(p.is_alive() for p in self.processes):
                _broadcast_object(self.control, None)
        except RuntimeError:
            pass  # a dead peer: the others are terminated below
        for p in self.processes:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
                p.join()
        if os.path.exists(self._store):
            os.unlink(self._store)


def _groups(rank: int, size: int, store_path: str, device_type: str) -> tuple[Any, Any]:
    """(the model's group, the control group) of this engine's ranks, over a file store."""
    timeout = timedelta(seconds=TIMEOUT_S)
    store = dist.FileStore(store_path, size)
    control = dist.ProcessGroupGloo(dist.PrefixStore("control", store), rank, size, timeout)
    if device_type != "cuda":
        return dist.ProcessGroupGloo(dist.PrefixStore("model", store), rank, size, timeout), control
    torch.cuda.set_device(rank)
    return dist.ProcessGroupNCCL(dist.PrefixStore("model", store), rank, size), control


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


def worker_main(rank: int, size: int, store: str, device_type: str) -> None:
    """A worker process: join the groups, build its share of the model and runner, follow rank 0's steps."""
    from vtcore.config import HFConfig
    from vtcore.layers.parallel import tensor_parallel
    from vtcore.loading.model_loader import build_model
    from vtcore.worker.model_runner import ModelRunner

    group, control = _groups(rank, size, store, device_type)
    setup: WorkerSetup = _broadcast_object(control, _RECEIVE)
    device = torch.device(device_type, rank) if device_type == "cuda" else torch.device("cpu")
    with tensor_parallel(rank, size, group):
        model, family = build_model(setup.model_path, HFConfig.from_path(setup.model_path), device, setup.dtype,
                                    setup.max_model_len, setup.load_format, setup.seed)
        runner = ModelRunner(model, family, attrs.evolve(setup.runner_config, device=device, depth=1))
    while (message := _broadcast_object(control, _RECEIVE)) is not None:
        runner.follow(message)
