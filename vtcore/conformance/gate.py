"""Running the gate over the registered families and quant methods, and reporting it (table, JSON, exit code)."""
from __future__ import annotations

import json
import os
import tempfile
from typing import TextIO, Union

from vtcore.conformance import CHECKS, QUANT_CHECKS
from vtcore.conformance.checks import CheckResult, FamilyGate
from vtcore.conformance.results import Progress
from vtcore.conformance.quant_checks import QuantGate
from vtcore.plugins.manager import Plugins, get_plugins, use_plugins
from vtcore.worker.tensor_parallel import reused_workers

Gate = Union[FamilyGate, QuantGate]


def run_gate(families: list[str] | None = None, device: str = "cpu", plugins: Plugins | None = None,
             quant: list[str] | None = None, checks: list[str] | None = None,
             tensor_parallel_size: int = 1, progress: Progress | None = None) -> list[Gate]:
    """Run every check (or ``checks`` and the ones they need) on each named family (default: all
    registered), then the quant checks of each named quant format (default: all registered; ``[]`` for
    none) over those families; every engine over ``tensor_parallel_size`` ranks; each check's result handed to
    ``progress`` as it ends."""
    plugins = plugins or get_plugins()
    names = families or sorted(plugins.families)
    formats = sorted(plugins.quant_methods) if quant is None else quant
    if device == "cuda":
        # The async checks demand token-exact equality across runs; GPU kernels are only
        # run-to-run exact in deterministic mode (docs/BENCHMARKS.md shows two sync runs differing
        # without it).
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        import torch

        torch.use_deterministic_algorithms(True)
    unknown = sorted(set(checks or ()) - set(CHECKS))
    if unknown:
        raise ValueError(f"checks={unknown}: not gate checks; expected some of {', '.join(CHECKS)}")
    for name in names:  # unknown names are errors naming the registered ones, before any check runs
        plugins.family(name)
    for fmt in formats:
        plugins.quant_method(fmt)
    gates: list[Gate] = []
    with tempfile.TemporaryDirectory(prefix="vtcore-conformance-") as workdir, use_plugins(plugins), \
            reused_workers():
        for name in names:
            gate = FamilyGate(plugins, plugins.family(name), device, workdir, tensor_parallel_size)
            gate.run(checks, progress)
            gates.append(gate)
        # A family that failed its own gate would fail the quant checks for its own fault: left out.
        failed = {g.name for g in gates if _failed(g)}
        for fmt in formats:
            gate = QuantGate(plugins, fmt, [plugins.family(n) for n in names if n not in failed], device, workdir,
                             left_out=sorted(failed), tensor_parallel_size=tensor_parallel_size)
            gate.run(progress)
            gates.append(gate)
    return gates


def passed(gates: list[Gate], unloaded: dict[str, str] | None = None) -> bool:
    """Every check that ran passed, and no plugin in ``unloaded`` (name -> load error: what the gate could not
    prove) failed to load."""
    return bool(gates) and not unloaded and all(r.status != "fail" for g in gates for r in g.results.values())


def _section(gates: list[Gate], checks: tuple[str, ...], title: str, out: TextIO) -> None:
    if not gates:
        return
    width = max([len(title)] + [len(g.name) for g in gates])
    families = [g for g in gates if isinstance(g, FamilyGate)]
    oracle_w = max([len("oracle")] + [len(g.oracle) for g in families]) if families else 0
    header = [title.ljust(width)] + (["oracle".ljust(oracle_w)] if families else []) + list(checks)
    out.write("  ".join(header) + "\n")
    for g in gates:
        cells = [g.name.ljust(width)] + ([g.oracle.ljust(oracle_w)] if families else [])
        cells += [g.results[c].status.upper().ljust(len(c)) for c in checks]
        out.write("  ".join(cells) + "\n")


def write_table(gates: list[Gate], out: TextIO, device: str, tensor_parallel_size: int = 1,
                unloaded: dict[str, str] | None = None) -> None:
    """Family x check and quant method x check, then what to fix for each failure, why each skip happened and
    each plugin in ``unloaded`` with its load error."""
    ranks = f", tensor_parallel_size {tensor_parallel_size}" if tensor_parallel_size > 1 else ""
    out.write(f"vtcore conformance (device {device}{ranks})\n")
    _section([g for g in gates if isinstance(g, FamilyGate)], CHECKS, "family", out)
    _section([g for g in gates if isinstance(g, QuantGate)], QUANT_CHECKS, "quant method", out)
    for g in gates:
        for r in g.results.values():
            if r.status == "fail":
                out.write(f"FAIL {r.check}: {r.detail}\n")
        after = CHECKS[CHECKS.index("oracle-greedy") + 1:]
        if isinstance(g, FamilyGate) and g.results["oracle-greedy"].status == "fail" and \
                any(g.results[c].status == "fail" for c in after):
            out.write(f"note {g.name}: oracle-greedy fails on the plainest requests: fix it first (the later checks "
                      "may fail of the same cause, whatever their hints say)\n")
        skips: dict[str, list[str]] = {}
        for r in g.results.values():
            if r.status == "skip":
                skips.setdefault(r.detail, []).append(r.check)
        for reason, checks in skips.items():
            out.write(f"skip {g.name} ({', '.join(checks)}): {reason}\n")
    for name, error in (unloaded or {}).items():
        out.write(f"NOT LOADED plugin {name}: {error}\n")
    out.write(summary(gates, unloaded) + "\n")


def _failed(g: Gate) -> bool:
    return any(r.status == "fail" for r in g.results.values())


def _plural(n: int, one: str, many: str) -> str:
    return f"{n} {one if n == 1 else many}"


def summary(gates: list[Gate], unloaded: dict[str, str] | None = None) -> str:
    """The last line: PASSED with the counts, or FAILED naming every family and quant method that failed and every
    plugin in ``unloaded``."""
    families = [g for g in gates if isinstance(g, FamilyGate)]
    quant = [g for g in gates if not isinstance(g, FamilyGate)]
    # a quant gate whose every check skipped proved nothing: counted apart
    skipped = [g for g in quant if all(r.status == "skip" for r in g.results.values())]
    if passed(gates, unloaded):
        return (f"PASSED: {_plural(len(families), 'family', 'families')}, "
                f"{_plural(len(quant), 'quant method', 'quant methods')}"
                + (f" ({len(skipped)} of them all skipped)" if skipped else ""))
    bad_fam = [g.name for g in families if _failed(g)]
    bad_quant = [g.name for g in quant if _failed(g)]
    fam = (f"{_plural(len(bad_fam), 'family', 'families')} ({', '.join(bad_fam)}) of {len(families)}" if bad_fam
           else f"families: {len(families)} passed")
    parts = ([f"{len(bad_quant)} failed ({', '.join(bad_quant)})"] if bad_quant else []) + \
        ([f"{len(quant) - len(bad_quant) - len(skipped)} passed"] if len(quant) > len(bad_quant) + len(skipped) else []) + \
        ([f"{len(skipped)} all skipped"] if skipped else [])
    not_loaded = f"; plugins that did not load: {', '.join(unloaded)}" if unloaded else ""
    return f"FAILED: {fam}; quant methods: {', '.join(parts) or 'none run'}{not_loaded}"


def to_json(gates: list[Gate], device: str, tensor_parallel_size: int = 1,
            unloaded: dict[str, str] | None = None, counted: bool = True) -> dict:
    """The report as JSON: ``unloaded`` (plugin -> load error) listed; they fail it only where ``counted`` (the
    whole gate: a run narrowed with --family proves what it names)."""
    def checks(g: Gate) -> dict:
        return {c: {"status": r.status, "detail": r.detail, "seconds": round(r.seconds, 3)}
                for c, r in g.results.items()}

    return {"device": device, "tensor_parallel_size": tensor_parallel_size,
            "passed": passed(gates, unloaded if counted else None),
            "unloaded_plugins": dict(unloaded or {}),
            "families": {g.name: {"plugin": g.family.plugin, "oracle": g.oracle, "checks": checks(g)}
                         for g in gates if isinstance(g, FamilyGate)},
            "quant": {g.name: {"plugin": g.plugins.quant_methods[g.fmt][0], "checks": checks(g)}
                      for g in gates if isinstance(g, QuantGate)}}


def progress_lines(stream: TextIO) -> Progress:
    """A ``Progress`` writing one line a check to ``stream`` (flushed): gate, check, status, seconds. A stream that
    cannot be written (a closed pipe, a full disk) ends the lines, not the gate."""
    broken = False

    def report(name: str, result: CheckResult) -> None:
        nonlocal broken
        if broken:
            return
        try:
            stream.write(f"{name}  {result.check}  {result.status.upper()}  {result.seconds:.1f} s\n")
            stream.flush()
        except OSError:
            broken = True
    return report


def main(families: list[str] | None, device: str, json_path: str | None, out: TextIO,
         quant: list[str] | None = None, checks: list[str] | None = None, tensor_parallel_size: int = 1,
         progress: TextIO | None = None) -> int:
    """The ``vtcore conformance`` command: exit code 1 on any failure (or nothing to check); a line a check on
    ``progress`` as it ends. Run over every family (no ``families``), it fails too when an installed plugin did
    not load: the gate cannot prove what it could not load."""
    plugins = get_plugins()
    counted = {} if families else plugins.errors
    gates = run_gate(families, device, plugins, quant=quant, checks=checks,
                     tensor_parallel_size=tensor_parallel_size,
                     progress=None if progress is None else progress_lines(progress))
    write_table(gates, out, device, tensor_parallel_size, counted)
    if json_path:
        with open(json_path, "w") as f:
            json.dump(to_json(gates, device, tensor_parallel_size, plugins.errors, not families), f, indent=2)
    return 0 if passed(gates, counted) else 1


__all__ = ["CheckResult", "run_gate", "passed", "summary", "write_table", "to_json", "progress_lines", "main"]
