"""``--structured-share``: which of a run's requests are held to the bench's JSON schema, and their report.

The in-process bench (``vtcore.bench.serving``) and the HTTP one (``vtcore.bench.http``: vLLM's
``structured_outputs`` field of a completions request) constrain the same requests to the same schema and
report the two groups alike, so a served run and an in-process one compare group by group.
"""
from __future__ import annotations

from typing import Any

from vtcore.bench.summary import summarize


def bench_schema(output_len: int) -> dict[str, Any]:
    """What --structured-share constrains requests to: an object of exactly ``output_len`` integers, finite
    but with at least a token an item, so a constrained request runs to ``max_tokens`` as the unconstrained
    ones do (with ``ignore_eos``). A grammar finished early would end its request early, and the closed loop's
    next arrivals would then prefill between the others' decode steps: a cost of the workload's shape, not of
    the constraint, in both groups' TPOT."""
    return {"type": "object", "properties": {"values": {
        "type": "array", "minItems": output_len, "maxItems": output_len,
        "items": {"type": "integer", "minimum": 0, "maximum": 999}}}, "required": ["values"]}


def check_share(share: float) -> float:
    """``share`` when it is a fraction of the requests; else ``ValueError`` naming it."""
    if not 0.0 <= share <= 1.0:
        raise ValueError(f"--structured-share={share}: expected a fraction of the requests, 0 to 1")
    return share


def constrained_flags(num_prompts: int, share: float) -> list[bool]:
    """Per request, whether it is constrained: request i is when the share's running count steps up at it
    (evenly interleaved; 0.5: every second one)."""
    return [int((i + 1) * share) > int(i * share) for i in range(num_prompts)]


def groups(results: list[dict[str, Any]], wall: float, share: float) -> dict[str, Any] | None:
    """The constrained and the unconstrained requests' share of a run (each result has ``constrained``,
    ``output_tokens``, ``tpot_s`` and ``finish_reason``): requests, output tokens over the run's wall time,
    TPOT; None without a share."""
    if not share:
        return None
    out = {}
    for name, held in (("constrained", True), ("unconstrained", False)):
        rs = [r for r in results if r["constrained"] == held]
        if rs:
            tokens = sum(r["output_tokens"] or 0 for r in rs)
            out[name] = {"requests": len(rs), "output_tokens": tokens, "output_throughput_tok_s": tokens / wall,
                         "tpot_s": summarize([r["tpot_s"] for r in rs if r["tpot_s"] is not None]),
                         "finish_reasons": sorted({str(r["finish_reason"]) for r in rs})}
    return out


def format_groups(run: dict[str, Any]) -> list[str]:
    """A line per group of a run that has them."""
    def ms(seconds: float | None) -> str:
        return "-" if seconds is None else f"{seconds * 1e3:.2f}"

    return [f"c={run['concurrency']} {name}: {g['requests']} requests, output {g['output_throughput_tok_s']:.1f} "
            f"tok/s, TPOT median {ms(g['tpot_s'].get('median'))} ms, finish {','.join(g['finish_reasons'])}"
            for name, g in (run.get("groups") or {}).items()]
