"""Child processes (``vtcore.worker.processes``): started from a fork server, with the parent's environment as
it is when each child starts; a tensor-parallel worker takes its share of the host's torch threads."""
from __future__ import annotations

import os

import pytest
import torch

from vtcore.worker import tensor_parallel
from vtcore.worker.processes import pipe, start_child

pytestmark = pytest.mark.timeout(120)


def _report_environ(conn, names) -> None:
    conn.send({name: os.environ.get(name) for name in names})


def _environ_of_a_child(names: list[str]) -> dict:
    ours, theirs = pipe()
    process = start_child(_report_environ, (theirs, names), "env-probe", daemon=True)
    theirs.close()
    try:
        return ours.recv()
    finally:
        process.join(timeout=30)


def test_a_child_gets_the_environment_of_its_start_not_of_the_servers(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("VTCORE_PROBE_GONE", "set before the first child")
    monkeypatch.setenv("VTCORE_PROBE", "first")
    assert _environ_of_a_child(["VTCORE_PROBE", "VTCORE_PROBE_GONE"]) == {
        "VTCORE_PROBE": "first", "VTCORE_PROBE_GONE": "set before the first child"}
    monkeypatch.setenv("VTCORE_PROBE", "second")  # the fork server (if any) runs with the first values
    monkeypatch.delenv("VTCORE_PROBE_GONE")
    assert _environ_of_a_child(["VTCORE_PROBE", "VTCORE_PROBE_GONE"]) == {"VTCORE_PROBE": "second",
                                                                         "VTCORE_PROBE_GONE": None}


class _Jobs:
    """A worker's pipe as ``worker_main`` reads it: the given jobs, then the stop."""

    def __init__(self, jobs: list[tuple]) -> None:
        self.jobs, self.sent = list(jobs) + [None], []

    def recv(self):
        return self.jobs.pop(0)

    def send(self, msg) -> None:
        self.sent.append(msg)


def test_a_worker_takes_its_ranks_share_of_the_threads(monkeypatch: pytest.MonkeyPatch) -> None:
    seen = []
    monkeypatch.setattr(tensor_parallel, "_serve", lambda rank, size, store, device: seen.append(
        (size, torch.get_num_threads())))
    monkeypatch.setattr(tensor_parallel, "thread_lock_for_progress", lambda: None)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(4)
        conn = _Jobs([(1, 2, "store"), (3, 4, "store"), (1, 8, "store")])
        tensor_parallel.worker_main(conn, "cpu")
    finally:
        torch.set_num_threads(before)
    assert conn.sent == ["joining"] * 3
    assert seen == [(2, 2), (4, 1), (8, 1)]
