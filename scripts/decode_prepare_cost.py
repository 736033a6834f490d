"""The host cost of laying out one padded decode step (``DecodeGraphs.prepare``) at ROWS running requests on
the embedded default model (CPU), median of 200 calls, beside the general per-row layout it replaces for
one-token rows, and of the step's sampling metas and ``Sampler.prepare`` (docs/BENCHMARKS.md).

    python3 scripts/decode_prepare_cost.py [ROWS]
"""
from __future__ import annotations

import random
import statistics
import sys
import time

from vtcore import LLM, SamplingParams
from vtcore.worker.model_runner import _sample_metas


def median_us(fn, *args) -> float:
    times = []
    for _ in range(200):
        t = time.perf_counter()
        fn(*args)
        times.append(time.perf_counter() - t)
    return statistics.median(times) * 1e6


def main() -> None:
    rows = int(sys.argv[1]) if len(sys.argv) > 1 else 128
    engine = LLM(device="cpu", max_num_seqs=rows).engine
    rng = random.Random(0)
    params = SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True)
    for i in range(rows):
        engine.add_request(f"r{i}", {"prompt_token_ids": [rng.randrange(1000) for _ in range(64)]}, params)
    graphs, batches = engine.runner.decode_graphs, []
    engine.runner.on_submit.append(lambda batch, done: batches.append(batch) if graphs.takes(batch) else None)
    while not batches or len(batches[-1]) < rows:
        engine.step()
    batch = batches[-1]
    metas = [m for s in batch for m in _sample_metas(s)]
    print(f"{rows} rows: prepare {median_us(graphs.prepare, batch):.1f} us, "
          f"general layout {median_us(graphs._prepare_rows, batch):.1f} us, "
          f"sampling metas {median_us(lambda: [m for s in batch for m in _sample_metas(s)]):.1f} us, "
          f"Sampler.prepare {median_us(engine.runner.sampler.prepare, metas):.1f} us")


if __name__ == "__main__":
    main()
