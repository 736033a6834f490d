"""The CPU collectives of two tensor-parallel ranks on one host (docs/BENCHMARKS.md): gloo's process group against
``vtcore.worker.shared_memory_group`` over it, microseconds a collective (median of ROUNDS timed batches), beside
the floor of any collective between processes: the shared-memory group's wake-up alone (a byte each way a peer).

    python3 scripts/bench_host_collectives.py [--ranks 2] [--rounds 7] [--iters 300]
"""
from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import statistics
import tempfile
import time
from datetime import timedelta

import torch
import torch.distributed as dist

from vtcore.worker.shared_memory_group import shared_memory_group

#: (name, shape): one decode row's hidden state of a tiny model, a 2,048-token chunk's, a step message's bytes
CASES = [("allreduce", (1, 128)), ("allreduce", (2048, 128)), ("allgather", (8, 512)), ("broadcast", (4096,))]


def _rank(rank: int, size: int, store: str, rounds: int, iters: int, out: mp.Queue) -> None:
    torch.set_num_threads(1)
    gloo = dist.ProcessGroupGloo(dist.PrefixStore("bench", dist.FileStore(store, size)), rank, size,
                                 timedelta(seconds=60))
    groups = {"gloo": gloo, "shared memory": shared_memory_group(rank, size, store, gloo, 60)}
    results = {}
    for name, group in groups.items():
        for op, shape in CASES:
            x = torch.randn(shape)
            parts = [torch.empty(shape) for _ in range(size)]
            call = {"allreduce": lambda: group.allreduce([x]).wait(),
                    "allgather": lambda: group.allgather([parts], [x]).wait(),
                    "broadcast": lambda: group.broadcast(x, 0).wait()}[op]
            results[f"{name} {op} {'x'.join(map(str, shape))}"] = _median_us(call, rounds, iters)
    results["floor: one byte to and from each peer"] = _median_us(groups["shared memory"]._exchange, rounds, iters)
    out.put((rank, results))


def _median_us(call, rounds: int, iters: int) -> float:
    for _ in range(20):
        call()
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        for _ in range(iters):
            call()
        times.append((time.perf_counter() - start) / iters * 1e6)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--iters", type=int, default=300)
    ap.add_argument("--json", default=None, help="also write the results here")
    args = ap.parse_args()
    store = os.path.join(tempfile.mkdtemp(), "store")
    ctx = mp.get_context("fork")
    out: mp.Queue = ctx.Queue()
    procs = [ctx.Process(target=_rank, args=(r, args.ranks, store, args.rounds, args.iters, out))
             for r in range(args.ranks)]
    for p in procs:
        p.start()
    by_rank = dict(out.get() for _ in procs)
    for p in procs:
        p.join()
    print(f"{'collective':42s} " + " ".join(f"rank {r:d} us" for r in sorted(by_rank)))
    for key in by_rank[0]:
        print(f"{key:42s} " + " ".join(f"{by_rank[r][key]:9.1f}" for r in sorted(by_rank)))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"ranks": args.ranks, "cpus": os.cpu_count(), "us": by_rank}, f, indent=1)


if __name__ == "__main__":
    main()
