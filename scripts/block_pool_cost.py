"""The block pool's hand-out and return of a new request's blocks, a base ``block_pool.py`` against the tree's, in
one process on the CPU.

    python scripts/block_pool_cost.py BASE_BLOCK_POOL_PY [--tokens 1000] [--rounds 400]
e.g. ``git show BASE:vtcore/engine/block_pool.py > /tmp/base_pool.py`` first. Each round, each pool (a 40,000-block
pool of 16-token blocks, prefix caching on; in alternating order) grows a new request's block list to hold
``--tokens`` tokens and frees it, each call timed by ``time.perf_counter``; medians in microseconds. Both classes in
one process, so a shared VM's drift falls on both alike.
"""
from __future__ import annotations

import argparse
import importlib.util
import statistics
import time

from vtcore.engine.block_pool import BlockPool


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("base", help="a block_pool.py of another commit")
    ap.add_argument("--tokens", type=int, default=1000)
    ap.add_argument("--rounds", type=int, default=400)
    args = ap.parse_args()
    spec = importlib.util.spec_from_file_location("base_block_pool", args.base)
    if spec is None or spec.loader is None:
        ap.error(f"{args.base}: expected a Python file")
    base = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(base)
    pools = {"base": base.BlockPool(40_000, 16, caching=True), "tree": BlockPool(40_000, 16, caching=True)}
    times: dict[str, list[tuple[float, float]]] = {name: [] for name in pools}
    for i in range(args.rounds):
        for name in (("base", "tree") if i % 2 else ("tree", "base")):
            blocks: list[int] = []
            t0 = time.perf_counter()
            pools[name].grow(blocks, args.tokens)
            t1 = time.perf_counter()
            pools[name].free(blocks)
            times[name].append((t1 - t0, time.perf_counter() - t1))
    for name, rows in times.items():
        grow, free = (statistics.median(column) * 1e6 for column in zip(*rows))
        blocks = -(-args.tokens // 16)
        print(f"{name}: grow {grow:.1f} us, free {free:.1f} us ({blocks} blocks, medians of {len(rows)})")


if __name__ == "__main__":
    main()
