"""How busy a served run keeps the processes on the host: each process's CPU time per wall second (cores) and
its busiest thread's, read from Linux's ``/proc`` (elsewhere there is nothing to read and the meter reports
nothing). A thread near 1.0 is saturated: an event loop or engine loop that is the bottleneck."""
from __future__ import annotations

import os
import time
from typing import Any

_TICK_S = 1.0 / os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 0.01


def thread_cpu_s(pid: int) -> dict[int, float]:
    """CPU seconds (user and system) of each thread of ``pid`` so far; empty when it cannot be read."""
    times = {}
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return {}
    for tid in tids:
        try:
            with open(f"/proc/{pid}/task/{tid}/stat", "rb") as f:
                fields = f.read().rsplit(b")", 1)[1].split()  # (the name before it may hold spaces)
        except OSError:
            continue  # the thread ended
        times[int(tid)] = (int(fields[11]) + int(fields[12])) * _TICK_S  # utime, stime
    return times


def process_tree(pid: int) -> list[int]:
    """``pid`` and its descendants, parents before children."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc") if os.path.isdir("/proc") else ():
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat", "rb") as f:
                    ppid = int(f.read().rsplit(b")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry))
    tree, todo = [], [pid]
    while todo:
        p = todo.pop(0)
        tree.append(p)
        todo.extend(sorted(children.get(p, ())))
    return tree


class CpuMeter:
    """The processes of a tree (``root`` and its descendants as the meter starts), measured from then."""

    def __init__(self, root: int) -> None:
        self.pids = process_tree(root)
        self.start = time.monotonic()
        self.before = {pid: thread_cpu_s(pid) for pid in self.pids}

    def shares(self) -> list[dict[str, Any]]:
        """Per process (root first): ``cores`` (its CPU seconds over the wall seconds since the start) and
        ``busiest_thread`` (the same of its busiest thread); descendants that took under 0.01 of a core are left
        out (a fork server, a parked worker)."""
        wall = time.monotonic() - self.start
        out = []
        for pid in self.pids:
            before, now = self.before[pid], thread_cpu_s(pid)
            used = [s - before.get(tid, 0.0) for tid, s in now.items()]
            if pid == self.pids[0] or used and sum(used) / wall >= 0.01:
                out.append({"pid": pid, "cores": sum(used) / wall, "busiest_thread": max(used, default=0.0) / wall})
        return out
