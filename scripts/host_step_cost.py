"""The host's work on a new prompt before its step's device work can start, on the CPU, by part.

    python scripts/host_step_cost.py [--input-len 1000] [--prefix-len 0] [--requests 60]
An ``LLMEngine`` of the embedded default model's shape (dummy weights) on the CPU (prefix caching on, its default)
takes one new prompt of random ids at a time (nothing of it cached; with ``--prefix-len N``, the same N ids before
each, whose blocks the first prompt registers: the prefix cache's hit, issue 21's case); each is added
(``add_request``), scheduled, laid out as its padded chunk step (``DecodeGraphs.prepare``) and staged
(``Staging.stage``), each part timed by ``time.perf_counter``, then dropped.
Where the engine has ``Scheduler.register_computed`` (block registration after the submit), that is timed apart as
``register``: the host's work after the device has its step. Medians in microseconds, after five unmeasured prompts.
A base vtcore first on ``PYTHONPATH`` measures the same parts of its own code (an A/B: interleave the runs).
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
    ap.add_argument("--prefix-len", type=int, default=0)
    ap.add_argument("--requests", type=int, default=60)
    args = ap.parse_args()
    if not 16 < args.input_len < 1024:  # (a whole block to hash; room under the model's 1,024 positions)
        ap.error(f"--input-len {args.input_len}: expected 17 to 1023 tokens")
    if not 0 <= args.prefix_len < 1024 - args.input_len:
        ap.error(f"--prefix-len {args.prefix_len}: expected 0 to {1023 - args.input_len} tokens (the prompt's "
                 "prefix and --input-len under the model's 1,024 positions)")
    if args.requests < 1:
        ap.error(f"--requests {args.requests}: expected at least 1")
    knobs = {"device": "cpu", "max_model_len": 1024, "load_format": "dummy"}
    engine = LLMEngine(engine_config("LLMEngine", None, knobs))
    scheduler, runner = engine.scheduler, engine.runner
    register = getattr(scheduler, "register_computed", None)
    rng = random.Random(0)
    prefix = [rng.randrange(1000) for _ in range(args.prefix_len)]
    rows: list[dict[str, float]] = []
    for i in range(args.requests + 5):
        rid, prompt = f"r{i}", prefix + [rng.randrange(1000) for _ in range(args.input_len)]
        params = SamplingParams(max_tokens=1)
        ta = time.perf_counter()
        engine.add_request(rid, {"prompt_token_ids": prompt}, params)
        t0 = time.perf_counter()
        batch = scheduler.schedule()
        t1 = time.perf_counter()
        graphs = next(g for g in runner._padded if g.takes(batch))
        inputs = graphs.prepare(batch)
        t2 = time.perf_counter()
        staged = runner.staging.stage(i, inputs.sections, align=1)
        t3 = time.perf_counter()
        if register is not None:
            register()
        t4 = time.perf_counter()
        runner.staging.retire(staged.index)
        engine.drop_request(rid)
        row = {"add": t0 - ta, "schedule": t1 - t0, "layout": t2 - t1, "stage": t3 - t2}
        if register is not None:
            row["register"] = t4 - t3
        rows.append({k: v * 1e6 for k, v in row.items()})
    rows = rows[5:]
    medians = {k: statistics.median(r[k] for r in rows) for k in rows[0]}
    before = medians["add"] + medians["schedule"] + medians["layout"] + medians["stage"]
    shared = f" after {args.prefix_len} cached" if args.prefix_len else ""
    print(f"a new {args.input_len}-token prompt{shared}, us (medians of {len(rows)}): "
          + ", ".join(f"{k} {v:.1f}" for k, v in medians.items()) + f"; before the device's work {before:.1f}")


if __name__ == "__main__":
    main()
