"""Tensor-parallel ranks for one engine: rank 0 is the engine's own runner, ranks 1.. are worker processes.

The scheduler, sampling and everything on the host stay with rank 0. Each step rank 0 prepares sends the
workers a ``StepMessage`` (its staged inputs and the metadata its forward needs) over a gloo control
group; every rank then runs the same forward on its share of the model (``vtcore.layers.parallel``: the
collectives inside it), rank 0 broadcasting the step's input ids after its combine (so in-flight tokens
come from rank 0's device mirror, and the workers need none), and the same ``compute_logits`` calls
(the logits are gathered on every rank). Only rank 0 samples. A worker that dies ends the engine with a
``TensorParallelError`` naming its rank and exit code; ``shutdown`` stops and joins every worker.
"""
from __future__ import annotations

import multiprocessing
import os
import tempfile
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

    model_path: str
    hf_config: dict[str, Any]
    dtype: torch.dtype
    max_model_len: int
    load_format: str
    seed: int
    runner_config: Any


def backend(device: torch.device) -> str:
    return "nccl" if device.type == "cuda" else "gloo"


class Peers:
    """Rank 0's side: the worker processes and the control group."""

    def __init__(self, size: int, device: torch.device) -> None:
        if dist.is_initialized():
            raise TensorParallelError("tensor_parallel_size > 1: this process already runs a tensor-parallel engine "
                                      "(or another torch.distributed group); one at a time: shut the other "
                                      "down first (its runner.shutdown())")
        self.size, self.device = size, device
        self._store = tempfile.NamedTemporaryFile(prefix="vtcore-tp-", delete=False).name
        os.unlink(self._store)  # the file rendezvous creates it
        context = multiprocessing.get_context("spawn")
        self.processes = [context.Process(target=worker_main, args=(rank, size, self._store, device.type),
                                          name=f"vtcore-tp-rank{rank}", daemon=True) for rank in range(1, size)]
        for p in self.processes:
            p.start()
        self.control = _init(0, size, self._store, device.type)

    def setup(self, setup: WorkerSetup) -> None:
        self._broadcast(setup)

    def send(self, message: StepMessage) -> None:
        self._broadcast(message)

    def _broadcast(self, obj: Any) -> None:
        self.check()
        try:
            dist.broadcast_object_list([obj], src=0, group=self.control)
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
        """Stop the workers (a stop message, then termination of any that lingers) and leave the group."""
        try:
            if all(p.is_alive() for p in self.processes):
                dist.broadcast_object_list([None], src=0, group=self.control)
        except RuntimeError:
            pass  # a dead peer: the others are terminated below
        for p in self.processes:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
                p.join()
        if dist.is_initialized():
            dist.destroy_process_group()


def _init(rank: int, size: int, store: str, device_type: str) -> Any:
    from datetime import timedelta

    if device_type == "cuda":
        torch.cuda.set_device(rank)
    dist.init_process_group(backend(torch.device(device_type)), init_method=f"file://{store}", rank=rank,
                            world_size=size, timeout=timedelta(seconds=TIMEOUT_S))
    return dist.new_group(backend="gloo", timeout=timedelta(seconds=TIMEOUT_S))


def worker_main(rank: int, size: int, store: str, device_type: str) -> None:
    """A worker process: join the group, build its share of the model and runner, follow rank 0's steps."""
    from vtcore.config import HFConfig
    from vtcore.layers.parallel import tensor_parallel
    from vtcore.loading.model_loader import build_model
    from vtcore.worker.model_runner import ModelRunner

    control = _init(rank, size, store, device_type)
    box: list[Any] = [None]
    dist.broadcast_object_list(box, src=0, group=control)
    setup: WorkerSetup = box[0]
    device = torch.device(device_type, rank) if device_type == "cuda" else torch.device("cpu")
    with tensor_parallel(rank, size):
        model, family = build_model(setup.model_path, HFConfig(setup.hf_config), device, setup.dtype,
                                    setup.max_model_len, setup.load_format, setup.seed)
        runner = ModelRunner(model, family, attrs.evolve(setup.runner_config, device=device, depth=1))
    while True:
        dist.broadcast_object_list(box, src=0, group=control)
        if box[0] is None:
            break
        runner.follow(box[0])
    dist.destroy_process_group()
