"""``vtcore bench``: benchmarks run through the engine's own front ends."""
from vtcore.bench.serving import add_bench_parser, cmd_bench, parse_concurrency, run_bench

__all__ = ["add_bench_parser", "cmd_bench", "parse_concurrency", "run_bench"]
