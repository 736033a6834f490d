"""Latency statistics the benchmarks report (mean, median, p90, p99), and how many requests a
concurrency runs."""
from __future__ import annotations

from typing import Sequence

#: the fewest requests a concurrency runs by default: a median of 4 (concurrency 1's 4 * c) moved by
#: more than a millisecond between runs of the served TTFT (docs/BENCHMARKS.md)
MIN_REQUESTS = 16


def requests_per_concurrency(c: int, num_prompts: int | None) -> int:
    """Requests completed at concurrency ``c``: ``--num-prompts`` when given (at least ``c``), else
    ``4 * c`` and at least ``MIN_REQUESTS``."""
    return max(num_prompts or max(4 * c, MIN_REQUESTS), c)


def _percentile(sorted_xs: list[float], q: float) -> float:
    """Linear-interpolated percentile (numpy's default) of an ascending list."""
    if len(sorted_xs) == 1:
        return sorted_xs[0]
    pos = (len(sorted_xs) - 1) * q / 100.0
    lo = int(pos)
    hi = min(lo + 1, len(sorted_xs) - 1)
    return sorted_xs[lo] + (sorted_xs[hi] - sorted_xs[lo]) * (pos - lo)


def summarize(xs: Sequence[float]) -> dict[str, float | None]:
    """mean, median, p90, p99 (seconds) of ``xs``; None each when there is nothing to summarize."""
    if not xs:
        return {"mean": None, "median": None, "p90": None, "p99": None, "count": 0}
    s = sorted(xs)
    return {"mean": sum(s) / len(s), "median": _percentile(s, 50), "p90": _percentile(s, 90),
            "p99": _percentile(s, 99), "count": len(s)}
