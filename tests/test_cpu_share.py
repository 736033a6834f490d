"""``vtcore.bench.cpu_share``: the CPU a process tree took per wall second, and its busiest thread's."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from vtcore.bench.cpu_share import CpuMeter, process_tree

pytestmark = [pytest.mark.timeout(60),
              pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="reads Linux's /proc")]

#: a child that waits on a grandchild spinning one thread
SPINNER = "import subprocess, sys; subprocess.run([sys.executable, '-c', 'while True: pass'])"


def test_the_meter_finds_the_spinning_grandchild_and_its_one_busy_thread() -> None:
    child = subprocess.Popen([sys.executable, "-c", SPINNER], start_new_session=True)
    try:
        deadline = time.monotonic() + 30
        while len(tree := process_tree(child.pid)) < 2 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert tree[0] == child.pid and len(tree) == 2, tree
        meter = CpuMeter(os.getpid())
        assert meter.pids[0] == os.getpid() and set(tree) <= set(meter.pids)  # parents before children
        time.sleep(0.6)
        shares = {s["pid"]: s for s in meter.shares()}
    finally:
        os.killpg(child.pid, signal.SIGKILL)
        child.wait()
    spinner = shares[tree[1]]
    assert 0.2 < spinner["busiest_thread"] <= spinner["cores"] <= 1.05
    assert shares.get(tree[0], {"cores": 0.0})["cores"] < 0.1  # the waiting child took (next to) nothing
