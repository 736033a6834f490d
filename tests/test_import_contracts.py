"""The import structure holds: ``lint-imports`` keeps every contract of ``[tool.importlinter]``
(pyproject.toml): vtcore.kernels imports nothing above it, vtcore.layers nothing that runs or serves
models, and no import cycle joins vtcore's subpackages or the modules of one.

``lint-imports`` is import-linter's entry point (``importlinter.cli:lint_imports_command``), called
here through the running interpreter: ``python -m importlinter.cli`` would define it and exit 0
without checking anything.
"""
from __future__ import annotations

import importlib.util
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
LINT_IMPORTS = "import sys; from importlinter.cli import lint_imports_command; sys.exit(lint_imports_command())"

pytestmark = pytest.mark.skipif(importlib.util.find_spec("importlinter") is None,
                                reason="import-linter is not installed (it is in vtcore's `test` extra)")


def _lint_imports(cwd: Path, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """``lint-imports --no-cache`` on ``ROOT``'s pyproject.toml, run in ``cwd`` (no cache is written)."""
    return subprocess.run([sys.executable, "-c", LINT_IMPORTS, "--no-cache", "--no-logo", str(ROOT / "pyproject.toml")],
                          cwd=cwd, env=env, capture_output=True, text=True, timeout=120)


def test_import_contracts_are_kept() -> None:
    r = _lint_imports(ROOT)
    assert r.returncode == 0, r.stdout + r.stderr
    assert re.search(r"Contracts: [1-9]\d* kept, 0 broken\.", r.stdout), r.stdout


def test_a_kernel_importing_a_layer_breaks_them(tmp_path: Path) -> None:
    """The contracts can fail: a copy of vtcore whose kernels import a layer breaks the kernels' contract
    and the no-cycles one (the layer imports kernels)."""
    shutil.copytree(ROOT / "vtcore", tmp_path / "vtcore", ignore=shutil.ignore_patterns("__pycache__", "default_model"))
    device = tmp_path / "vtcore" / "kernels" / "device.py"
    device.write_text(device.read_text() + "\nfrom vtcore.layers.norm import RMSNorm  # noqa: E402,F401\n")
    r = _lint_imports(tmp_path, env={**os.environ, "PYTHONPATH": str(tmp_path)})
    assert r.returncode == 1, r.stdout + r.stderr
    assert "vtcore.kernels is not allowed to import vtcore.layers" in r.stdout, r.stdout
    assert "vtcore.kernels.device -> vtcore.layers.norm" in r.stdout, r.stdout
    assert "No cycles are allowed in vtcore." in r.stdout, r.stdout
