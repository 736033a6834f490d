"""The README's test command is the one CI runs."""
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_ci_runs_the_readme_test_command() -> None:
    ci = (ROOT / ".ci" / "run").read_text().strip().splitlines()[-1]
    assert ci.startswith("pip install") and "pytest" in ci
    assert ci in (ROOT / "README.md").read_text()
