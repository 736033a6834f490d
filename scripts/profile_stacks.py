"""Run a ``vtcore`` command with a sampling profiler of every Python thread (docs/BENCHMARKS.md).

    python3 scripts/profile_stacks.py OUT.txt serve --model ...     (any ``vtcore`` command line)

Every 2 ms each thread's stack is read (``sys._current_frames``); at exit OUT.txt lists, per thread, the
share of samples in which each function was on the stack (inclusive) and each line was running (leaf).
Shares are of the whole run, start-up included; idle threads count as samples too. Python processes the
command starts (the engine core process of ``vtcore serve``) are sampled too, each into OUT.txt.PID: a
``sitecustomize`` on their ``PYTHONPATH`` starts the sampler in them; their tables are rewritten every
``DUMP_EVERY`` samples, since a child may be ended without running its exit handlers.
"""
from __future__ import annotations

import atexit
import collections
import sys
import threading
import time
import traceback

INTERVAL_S = 0.002
DUMP_EVERY = 1000
CHILD_OUT = "VTCORE_PROFILE_STACKS_OUT"  # set for the command's child processes: their tables' path prefix


def _where(frame: traceback.FrameSummary, line: bool) -> str:
    name = frame.filename.split("site-packages/")[-1]
    return f"{name}:{frame.lineno} {frame.name}" if line else f"{name}:{frame.name}"


def start(path: str, dump_every: int = 0) -> None:
    inclusive: collections.Counter = collections.Counter()
    leaf: collections.Counter = collections.Counter()
    samples = [0]

    def run() -> None:
        me = threading.get_ident()  # the sampler's own thread, left out
        while True:
            time.sleep(INTERVAL_S)
            samples[0] += 1
            if dump_every and samples[0] % dump_every == 0:
                dump()
            names = {t.ident: t.name for t in threading.enumerate()}
            for tid, frame in sys._current_frames().items():
                if tid == me:
                    continue
                thread, stack = names.get(tid, str(tid)), traceback.extract_stack(frame)
                if stack:
                    leaf[(thread, _where(stack[-1], True))] += 1
                for key in {(thread, _where(f, False)) for f in stack}:
                    inclusive[key] += 1

    def dump() -> None:
        n = max(samples[0], 1)
        with open(path, "w") as f:
            f.write(f"samples {samples[0]} every {INTERVAL_S * 1e3:g} ms\n== inclusive (thread, function)\n")
            f.writelines(f"{c / n:6.3f} {t:20s} {k}\n" for (t, k), c in inclusive.most_common(200))
            f.write("== leaf lines\n")
            f.writelines(f"{c / n:6.3f} {t:20s} {k}\n" for (t, k), c in leaf.most_common(100))

    threading.Thread(target=run, daemon=True, name="stack-sampler").start()
    atexit.register(dump)


def _sample_children(path: str) -> None:
    """Children started with this environment run a ``sitecustomize`` that samples them into ``path.PID``, and so
    do the processes they fork (multiprocessing's fork server forks vtcore's children)."""
    import os
    import tempfile

    site = tempfile.mkdtemp(prefix="vtcore-stacks-")
    with open(os.path.join(site, "sitecustomize.py"), "w") as f:
        f.write("import os, sys\n"
                f"sys.path.insert(0, {os.path.dirname(os.path.abspath(__file__))!r})\n"
                "import profile_stacks\n"
                "def _start():\n"
                f"    profile_stacks.start(os.environ[{CHILD_OUT!r}] + '.' + str(os.getpid()), profile_stacks.DUMP_EVERY)\n"
                "_start()\n"
                "os.register_at_fork(after_in_child=_start)  # (children forked from a fork server: the engine core)\n")
    os.environ[CHILD_OUT] = path
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [site, os.environ.get("PYTHONPATH")]))


if __name__ == "__main__":
    if len(sys.argv) < 3:
        sys.exit(__doc__)
    start(sys.argv[1])
    _sample_children(sys.argv[1])
    from vtcore.cli.main import main

    sys.exit(main(sys.argv[2:]))
