"""The block pool's work for a new request, a base ``block_pool.py`` against the tree's, in one process on the CPU.

    python scripts/block_pool_cost.py BASE_BLOCK_POOL_PY [--tokens 1000] [--prefix-len 2048] [--rounds 400]
e.g. ``git show BASE:vtcore/engine/block_pool.py > /tmp/base_pool.py`` first. Each pool (40,000 blocks of 16 tokens,
prefix caching on) has registered the blocks of one ``--prefix-len``-token prefix of random ids. Each round, each
pool in alternating order: grows a new request's block list to hold ``--tokens`` tokens and frees it, then looks
up a prompt of that prefix and 128 new ids (``hashes`` to the first uncached block, ``match``; issue 21's hit), each
timed by ``time.perf_counter``; medians in microseconds. Both classes in one process, so a shared VM's drift falls
on both alike.
"""
from __future__ import annotations

import argparse
import importlib.util
import random
import statistics
import time

from vtcore.engine.block_pool import BlockPool


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("base", help="a block_pool.py of another commit")
    ap.add_argument("--tokens", type=int, default=1000)
    ap.add_argument("--prefix-len", type=int, default=2048)
    ap.add_argument("--rounds", type=int, default=400)
    args = ap.parse_args()
    spec = importlib.util.spec_from_file_location("base_block_pool", args.base)
    if spec is None or spec.loader is None:
        ap.error(f"{args.base}: expected a Python file")
    base = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(base)
    pools = {"base": base.BlockPool(40_000, 16, caching=True), "tree": BlockPool(40_000, 16, caching=True)}
    rng = random.Random(0)
    prefix = [rng.randrange(150_000) for _ in range(args.prefix_len)]
    for pool in pools.values():
        blocks: list[int] = []
        pool.grow(blocks, len(prefix))
        pool.cache(blocks, pool.hashes(prefix, [], len(prefix) // 16))
        pool.free(blocks)
    times: dict[str, list[tuple[float, float, float]]] = {name: [] for name in pools}
    for i in range(args.rounds):
        prompt = prefix + [rng.randrange(150_000) for _ in range(128)]
        for name in (("base", "tree") if i % 2 else ("tree", "base")):
            pool, blocks = pools[name], []
            t0 = time.perf_counter()
            pool.grow(blocks, args.tokens)
            t1 = time.perf_counter()
            pool.free(blocks)
            t2 = time.perf_counter()
            found = pool.match(pool.hashes(prompt, [], (len(prompt) - 1) // 16, until_uncached=True))
            t3 = time.perf_counter()
            pool.free(found)
            times[name].append((t1 - t0, t2 - t1, t3 - t2))
    blocks_needed = -(-args.tokens // 16)
    for name, rows in times.items():
        grow, free, hit = (statistics.median(column) * 1e6 for column in zip(*rows))
        print(f"{name}: grow {grow:.1f} us, free {free:.1f} us ({blocks_needed} blocks); a hit's lookup of "
              f"{args.prefix_len // 16} cached blocks {hit:.1f} us (medians of {len(rows)})")

if __name__ == "__main__":
    main()
