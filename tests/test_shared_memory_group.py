"""``SharedMemoryGroup`` (``vtcore.worker.shared_memory_group``), the CPU collectives of tensor-parallel ranks:
three ranks (this process and two children) run many collectives in a row, each rank's tensors known to all, and
every rank must hold exactly the expected result (the sum in rank order: the same bits on every rank); a tensor
over the slot size goes through the gloo group underneath; a rank that exits fails its peers' next collective
at once, naming it."""
from __future__ import annotations

import mmap
import os
import socket
import time
import traceback
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from vtcore.worker.processes import pipe, start_child
from vtcore.worker.shared_memory_group import SharedMemoryGroup, shared_memory_group

pytestmark = pytest.mark.timeout(120)
SIZE, ROUNDS, SLOT = 3, 60, 4096  # (a 4 KiB slot: the 2 x 1024-float tensors go through gloo)


def _gloo(rank: int, store: str, size: int = SIZE) -> dist.ProcessGroup:
    return dist.ProcessGroupGloo(dist.PrefixStore("t", dist.FileStore(store, size)), rank, size, timedelta(seconds=60))


def _group(rank: int, store: str) -> SharedMemoryGroup:
    return shared_memory_group(rank, SIZE, store, _gloo(rank, store), 60, slot_bytes=SLOT)


def _tensor(rank: int, i: int, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * i + rank)
    return torch.randn(shape, generator=g).to(dtype)


def _collectives(group: SharedMemoryGroup) -> None:
    """ROUNDS rounds of every collective, at shapes inside and over the slot, each checked on this rank."""
    rank = group.rank
    for i in range(ROUNDS):
        shape, dtype = [((3, 5), torch.float32), ((7, 2), torch.bfloat16), ((2, 1024), torch.float32)][i % 3]
        x = _tensor(rank, i, shape, dtype)
        group.allreduce([x]).wait()
        want = _tensor(0, i, shape, dtype)
        for r in range(1, SIZE):
            want += _tensor(r, i, shape, dtype)
        assert torch.equal(x, want) if x.numel() * 4 <= SLOT else torch.allclose(x, want, atol=1e-5), (i, shape)
        parts = [torch.empty(shape, dtype=dtype) for _ in range(SIZE)]
        group.allgather([parts], [_tensor(rank, i, shape, dtype)]).wait()
        assert all(torch.equal(p, _tensor(r, i, shape, dtype)) for r, p in enumerate(parts)), i
        y = _tensor(rank, i, shape, dtype)
        group.broadcast(y, i % SIZE).wait()
        assert torch.equal(y, _tensor(i % SIZE, i, shape, dtype)), i


def _rank_main(rank: int, store: str, conn, exit_early: bool) -> None:
    try:
        group = _group(rank, store)
        if exit_early:
            conn.send("joined")
            os._exit(0)  # (as a killed worker: no goodbye)
        _collectives(group)
        conn.send("ok")
    except BaseException:  # noqa: BLE001 - the parent reports it
        conn.send(traceback.format_exc())


def _rank_kind(rank: int, store: str, conn, exit_early: bool) -> None:
    conn.send(type(_group(rank, store)).__name__)


def _children(store: str, exit_early: bool = False, target=_rank_main) -> list:
    out = []
    for rank in range(1, SIZE):
        ours, theirs = pipe()
        process = start_child(target, (rank, store, theirs, exit_early and rank == 2), f"shm-rank{rank}",
                              daemon=True)
        theirs.close()
        out.append((process, ours))
    return out


def test_many_collectives_give_every_rank_the_exact_result(tmp_path) -> None:
    store = str(tmp_path / "store")
    children = _children(store)
    group = _group(0, store)
    assert isinstance(group, SharedMemoryGroup) and sorted(group.peers) == [1, 2]
    assert [p.gettimeout() for p in group.peers.values()] == [None, None]  # (wait_s: a peer may idle for ever)
    _collectives(group)
    assert [conn.recv() for _, conn in children] == ["ok", "ok"]
    assert not [f for f in os.listdir(tmp_path) if f != "store"]  # the sockets' and the shared file's names are gone
    group.close()
    for process, _ in children:
        process.join(timeout=30)


def test_a_rank_that_exits_fails_its_peers_next_collective_naming_it(tmp_path) -> None:
    store = str(tmp_path / "store")
    children = _children(store, exit_early=True)
    group = _group(0, store)
    assert children[1][1].recv() == "joined"
    children[1][0].join(timeout=30)
    started = time.monotonic()
    with pytest.raises(RuntimeError, match="rank 2 closed its connection to rank 0"):
        group.allreduce([torch.ones(4)]).wait()
    assert time.monotonic() - started < 10
    with pytest.raises(RuntimeError, match="rank 2 closed its connection to rank 0"):  # out of step: every later one
        group.broadcast(torch.ones(4), 0).wait()
    group.close()
    group.close()  # (again: nothing)
    for process, _ in children:
        process.kill()
        process.join(timeout=30)


def _rank_joins_gloo_then_exits(store: str, conn) -> None:
    _gloo(1, store, size=2)
    conn.send("joined")
    os._exit(0)


def test_a_join_that_fails_leaves_no_file_behind(tmp_path, monkeypatch) -> None:
    """A peer that exits while the group is being made (a worker killed as the engine starts): the joining rank
    fails, and neither the shared file (a tmpfs one holds memory until a reboot) nor a socket's name is left."""
    from vtcore.worker import shared_memory_group as module

    shm = tmp_path / "shm"
    shm.mkdir()
    monkeypatch.setattr(module, "_data_paths", lambda prefix: [str(shm / "data")])
    store = str(tmp_path / "store")
    ours, theirs = pipe()
    process = start_child(_rank_joins_gloo_then_exits, (store, theirs), "shm-join-exit", daemon=True)
    theirs.close()
    gloo = _gloo(0, store, size=2)
    assert ours.recv() == "joined"
    process.join(timeout=30)
    with pytest.raises(RuntimeError):
        shared_memory_group(0, 2, store + ".g", gloo, 20)
    assert os.listdir(shm) == [] and sorted(os.listdir(tmp_path)) == ["shm", "store"]


def test_slots_serve_inside_and_outside_inference_mode_alike(tmp_path) -> None:
    """A slot's view is kept across collectives: one first made under ``torch.inference_mode`` must still take
    the copies of a collective outside it (the engine runs steps in inference mode, the gate's checks not
    always), and the other way round."""
    a, b = socket.socketpair()
    group = SharedMemoryGroup(0, 2, mmap.mmap(-1, 2 * 2 * SLOT), {1: a}, fallback=None, slot_bytes=SLOT)
    b.sendall(b"\0" * 8)  # (rank 1's words for the four collectives below)
    for inference_first in (True, False):
        for inference in (inference_first, not inference_first, inference_first, not inference_first):
            x = torch.full((2, 3), 2.0)
            with torch.inference_mode(inference):
                group.broadcast(x, 0).wait()
            assert torch.equal(x, torch.full((2, 3), 2.0))
    group.close()
    b.close()


def test_where_rank_0_cannot_make_the_shared_file_every_rank_keeps_gloo(tmp_path, monkeypatch) -> None:
    from vtcore.worker import shared_memory_group as module

    monkeypatch.setattr(module, "_data_paths", lambda prefix: [str(tmp_path / "no-such-folder" / "data")])
    children = _children(str(tmp_path / "store"), target=_rank_kind)
    assert type(_group(0, str(tmp_path / "store"))).__name__ == "ProcessGroupGloo"
    assert [conn.recv() for _, conn in children] == ["ProcessGroupGloo", "ProcessGroupGloo"]
    for process, _ in children:
        process.join(timeout=30)


def test_a_collective_that_timed_out_leaves_the_group_failing(tmp_path) -> None:
    """A peer that answers after the wait's bound: the group is out of step (the late word would pair with the
    next collective, whose slots the peer has not written), so every later collective fails as the first did."""
    a, b = socket.socketpair()
    a.settimeout(0.2)
    group = SharedMemoryGroup(0, 2, mmap.mmap(-1, 2 * 2 * SLOT), {1: a}, fallback=None, slot_bytes=SLOT)
    with pytest.raises(RuntimeError, match="rank 1 did not answer rank 0"):
        group.broadcast(torch.ones(3), 0).wait()
    b.sendall(b"\0")  # (rank 1's word, late)
    with pytest.raises(RuntimeError, match="rank 1 did not answer rank 0"):
        group.broadcast(torch.ones(3), 0).wait()
    group.close()
    b.close()


def test_a_closed_group_fails_its_collectives_saying_so() -> None:
    a, b = socket.socketpair()
    group = SharedMemoryGroup(0, 2, mmap.mmap(-1, 2 * 2 * SLOT), {1: a}, fallback=None, slot_bytes=SLOT)
    group.close()
    for call in (lambda: group.allreduce([torch.ones(2)]), lambda: group.broadcast(torch.ones(2), 0),
                 lambda: group.allgather([[torch.ones(2), torch.ones(2)]], [torch.ones(2)])):
        with pytest.raises(RuntimeError, match="rank 0's group is closed"):
            call()
    b.close()
