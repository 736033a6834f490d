"""A lone prefill chunk's host layout and staging, the chunk path against the general per-row path, on the CPU.

    python scripts/chunk_layout_cost.py [--input-len 1000] [--requests 200]
An ``LLMEngine`` of the embedded default model's shape (dummy weights) on the CPU takes one new prompt of random ids
at a time; its step (one chunk alone) is laid out by ``DecodeGraphs._prepare_chunk`` (positions, KV slots and
combine as native int64 buffers) and by ``DecodeGraphs._prepare_rows`` (a Python int a token), each staged
(``Staging.stage``), the two in alternating order within the same request, each part timed by
``time.perf_counter``. The same process measures both, so the machine's drifts (a shared VM's clock can move
both by 1.5x between runs) fall on both alike. Medians in microseconds after five unmeasured prompts, and the
median of the per-request ratios chunk / rows of layout plus staging.
"""
from __future__ import annotations

import argparse
import random
import statistics
import time

from vtcore import SamplingParams
from vtcore.engine.arg_utils import engine_config
from vtcore.engine.llm_engine import LLMEngine


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--input-len", type=int, default=1000)
    ap.add_argument("--requests", type=int, default=200)
    args = ap.parse_args()
    if not 0 < args.input_len < 1024:
        ap.error(f"--input-len {args.input_len}: expected 1 to 1023 tokens (the model's 1,024 positions)")
    if args.requests < 1:
        ap.error(f"--requests {args.requests}: expected at least 1")
    engine = LLMEngine(engine_config("LLMEngine", None, {"device": "cpu", "max_model_len": 1024,
                                                         "load_format": "dummy"}))
    scheduler, runner = engine.scheduler, engine.runner
    rng = random.Random(0)
    rows: list[dict[str, float]] = []
    for i in range(args.requests + 5):
        engine.add_request(f"r{i}", {"prompt_token_ids": [rng.randrange(1000) for _ in range(args.input_len)]},
                           SamplingParams(max_tokens=1))
        batch = scheduler.schedule()
        graphs = next(g for g in runner._padded if g.takes(batch))
        row = {}
        for path in (("chunk", "rows") if i % 2 else ("rows", "chunk")):
            t0 = time.perf_counter()
            inputs = graphs._prepare_chunk(batch[0]) if path == "chunk" else graphs._prepare_rows(batch)
            t1 = time.perf_counter()
            staged = runner.staging.stage(i, inputs.sections, align=1)
            t2 = time.perf_counter()
            runner.staging.retire(staged.index)
            row[f"{path} layout"], row[f"{path} stage"] = (t1 - t0) * 1e6, (t2 - t1) * 1e6
        scheduler.register_computed()
        engine.drop_request(f"r{i}")
        rows.append(row)
    rows = rows[5:]
    medians = {k: statistics.median(r[k] for r in rows) for k in rows[0]}
    ratio = statistics.median((r["chunk layout"] + r["chunk stage"]) / (r["rows layout"] + r["rows stage"])
                              for r in rows)
    print(f"a lone {args.input_len}-token chunk, us (medians of {len(rows)}): "
          + ", ".join(f"{k} {v:.1f}" for k, v in sorted(medians.items()))
          + f"; chunk / rows (layout + stage, median per request) {ratio:.2f}")


if __name__ == "__main__":
    main()
