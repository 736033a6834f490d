"""The host cost of structured outputs a decode step (docs/BENCHMARKS.md): for R constrained rows held to
the bench's JSON schema (``vtcore.bench.structured_share.bench_schema(128)``, the embedded default model's tokenizer,
logits as wide as the Qwen3 vocabulary, compiled as the engine compiles it: ``GrammarCache``), the medians
over a walk through the grammar of accepting one token a row and filling the rows' bitmasks, one matcher
at a time (what the engine does) and through xgrammar's ``BatchGrammarMatcher`` (C++ threads).

    python3 scripts/grammar_host_cost.py [ROWS] [VOCAB]
"""
from __future__ import annotations

import json
import random
import statistics
import sys
import time

import torch
import xgrammar as xgr
from transformers import AutoTokenizer

from vtcore.bench.structured_share import bench_schema
from vtcore.config import DEFAULT_MODEL
from vtcore.structured import StructuredOutputsParams
from vtcore.structured.grammar import GrammarCache


def main() -> None:
    rows = int(sys.argv[1]) if len(sys.argv) > 1 else 16
    vocab = int(sys.argv[2]) if len(sys.argv) > 2 else 151936
    tokenizer = AutoTokenizer.from_pretrained(DEFAULT_MODEL)
    cache = GrammarCache(tokenizer, vocab, [tokenizer.eos_token_id])
    grammar = cache.compile(StructuredOutputsParams(json=bench_schema(128)))
    mask = xgr.allocate_token_bitmask(rows, cache.tokens)
    rng = random.Random(0)
    times: dict[str, list[float]] = {k: [] for k in ("accept", "fill", "batch_accept", "batch_fill")}
    for batch in (False, True):
        matchers = [xgr.GrammarMatcher(grammar) for _ in range(rows)]
        batcher = xgr.BatchGrammarMatcher() if batch else None
        for _ in range(64):
            t0 = time.perf_counter()
            if batcher:
                batcher.batch_fill_next_token_bitmask(matchers, mask)
            else:
                for i, m in enumerate(matchers):
                    m.fill_next_token_bitmask(mask, i)
            t1 = time.perf_counter()
            allowed = [torch.nonzero(((mask[i, :, None] >> torch.arange(32)) & 1).flatten()).flatten().tolist()
                       for i in range(rows)]
            tokens = [rng.choice(a) if a else 0 for a in allowed]
            t2 = time.perf_counter()
            if batcher:
                batcher.batch_accept_token(matchers, tokens)
            else:
                for m, t in zip(matchers, tokens):
                    m.accept_token(t)
            t3 = time.perf_counter()
            times["batch_fill" if batch else "fill"].append((t1 - t0) * 1e3)
            times["batch_accept" if batch else "accept"].append((t3 - t2) * 1e3)
            if any(m.is_terminated() for m in matchers):
                matchers = [xgr.GrammarMatcher(grammar) for _ in range(rows)]
    stats = {k: {"median_ms": statistics.median(v), "max_ms": max(v)} for k, v in times.items()}
    print(json.dumps({"rows": rows, "logits": vocab, "matcher_tokens": cache.tokens, **stats}))


if __name__ == "__main__":
    main()
