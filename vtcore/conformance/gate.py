"""Running the gate over the registered families, and reporting it (table, JSON, exit code)."""
from __future__ import annotations

import json
import os
import tempfile
from typing import TextIO

from vtcore.conformance import CHECKS
from vtcore.conformance.checks import CheckResult, FamilyGate
from vtcore.plugins.manager import Plugins, get_plugins, use_plugins


def run_gate(families: list[str] | None = None, device: str = "cpu",
             plugins: Plugins | None = None) -> list[FamilyGate]:
    """Run every check on each named family (default: every registered family)."""
    plugins = plugins or get_plugins()
    names = families or sorted(plugins.families)
    if device == "cuda":
        # The async checks demand token-exact equality across runs; GPU kernels are only
        # run-to-run exact in deterministic mode (docs/BENCHMARKS.md shows two sync runs differing
        # without it).
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        import torch

        torch.use_deterministic_algorithms(True)
    gates = []
    with tempfile.TemporaryDirectory(prefix="vtcore-conformance-") as workdir, use_plugins(plugins):
        for name in names:
            gate = FamilyGate(plugins, plugins.family(name), device, workdir)
            gate.run()
            gates.append(gate)
    return gates


def passed(gates: list[FamilyGate]) -> bool:
    return bool(gates) and all(r.status != "fail" for g in gates for r in g.results.values())


def write_table(gates: list[FamilyGate], out: TextIO, device: str) -> None:
    """Family x check, then what to fix for each failure and why each skip happened."""
    width = max([len("family")] + [len(g.name) for g in gates])
    oracle_w = max([len("oracle")] + [len(g.oracle) for g in gates])
    header = ["family".ljust(width), "oracle".ljust(oracle_w)] + [c for c in CHECKS]
    out.write(f"vtcore conformance (device {device})\n")
    out.write("  ".join(header) + "\n")
    for g in gates:
        cells = [g.name.ljust(width), g.oracle.ljust(oracle_w)]
        cells += [g.results[c].status.upper().ljust(len(c)) for c in CHECKS]
        out.write("  ".join(cells) + "\n")
    for g in gates:
        for r in g.results.values():
            if r.status == "fail":
                out.write(f"FAIL {r.check}: {r.detail}\n")
        skips: dict[str, list[str]] = {}
        for r in g.results.values():
            if r.status == "skip":
                skips.setdefault(r.detail, []).append(r.check)
        for reason, checks in skips.items():
            out.write(f"skip {g.name} ({', '.join(checks)}): {reason}\n")
    out.write(("PASSED" if passed(gates) else "FAILED") + f": {len(gates)} famil{'y' if len(gates) == 1 else 'ies'}\n")


def to_json(gates: list[FamilyGate], device: str) -> dict:
    return {"device": device, "passed": passed(gates), "families": {
        g.name: {"plugin": g.family.plugin, "oracle": g.oracle,
                 "checks": {c: {"status": r.status, "detail": r.detail} for c, r in g.results.items()}}
        for g in gates}}


def main(families: list[str] | None, device: str, json_path: str | None, out: TextIO) -> int:
    """The ``vtcore conformance`` command: exit code 1 on any failure (or no family at all)."""
    gates = run_gate(families, device)
    write_table(gates, out, device)
    if json_path:
        with open(json_path, "w") as f:
            json.dump(to_json(gates, device), f, indent=2)
    return 0 if passed(gates) else 1


__all__ = ["CheckResult", "run_gate", "passed", "write_table", "to_json", "main"]
