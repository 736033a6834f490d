"""``vtcore new-plugin``: the scaffold installs with pip, registers, and the gate reports it unfinished."""
from __future__ import annotations

import io
import os
import subprocess
import sys

import pytest

from vtcore.cli.main import main


def test_scaffold_installs_and_the_gate_reports_the_unfinished_model(tmp_path) -> None:
    out = io.StringIO()
    assert main(["new-plugin", "mistral", "--arch", "MistralForCausalLM", "--dir", str(tmp_path)], out=out) == 0
    root = tmp_path / "vtcore-mistral"
    assert f"wrote {root}" in out.getvalue()
    assert sorted(p.name for p in (root / "vtcore_mistral").iterdir()) == ["__init__.py", "model.py", "plugin.py"]
    assert (root / "tests" / "test_mistral_conformance.py").exists()
    site = tmp_path / "site"
    pip = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation",
                          "--target", str(site), str(root)], capture_output=True, text=True, timeout=240)
    assert pip.returncode == 0, pip.stderr
    env = {**os.environ, "PYTHONPATH": str(site)}
    models = subprocess.run([sys.executable, "-m", "vtcore.cli.main", "models"], capture_output=True, text=True,
                            env=env, timeout=120)
    assert "MistralForCausalLM" in models.stdout and "plugin=mistral" in models.stdout
    gate = subprocess.run([sys.executable, "-m", "vtcore.cli.main", "conformance", "--family", "mistral"],
                          capture_output=True, text=True, env=env, timeout=240)
    assert gate.returncode == 1, gate.stdout + gate.stderr
    assert "FAIL structure: family 'mistral': structure raised NotImplementedError: " \
           "vtcore_mistral.model.MistralForCausalLM is an unfinished scaffold" in gate.stdout
    assert "transformers:MistralForCausalLM  PASS" in gate.stdout  # its example (and oracle) are already usable


@pytest.mark.parametrize("argv, message", [
    (["new-plugin", "My-Family", "--arch", "XForCausalLM"], "NAME='My-Family': expected a lowercase identifier"),
    (["new-plugin", "fam", "--arch", "not a class"], "--arch='not a class': expected an HF architecture class name"),
    (["new-plugin", "fam", "--arch", "llama"], "--arch='llama': expected an HF architecture class name"),  # model_type
    (["new-plugin", "fam", "--arch", "Qwen3ForCausalLM"], "--arch='Qwen3ForCausalLM': installed plugin qwen3_dense "
                                                          "serves it already"),
])
def test_scaffold_rejects_bad_names(argv, message, tmp_path, capsys) -> None:
    assert main([*argv, "--dir", str(tmp_path)]) == 2
    assert message in capsys.readouterr().err


def test_scaffold_refuses_to_overwrite(tmp_path, capsys) -> None:
    assert main(["new-plugin", "fam", "--arch", "MistralForCausalLM", "--dir", str(tmp_path)], out=io.StringIO()) == 0
    assert main(["new-plugin", "fam", "--arch", "MistralForCausalLM", "--dir", str(tmp_path)]) == 2
    assert "already exists" in capsys.readouterr().err


@pytest.mark.parametrize("arch, model_type", [
    ("LlamaForCausalLM", "llama"),  # exaone, internlm3 ... map to it too, and come first in transformers' table
    ("GPT2LMHeadModel", "gpt2"), ("Qwen3_5ForCausalLM", "qwen3_5_text"), ("NoSuchForCausalLM", "TODO-model-type"),
])
def test_scaffold_example_takes_the_model_type_of_the_class(arch, model_type) -> None:
    """The example's model_type decides the oracle's checkpoint names: with 'exaone' for Llama, a
    correct Llama plugin failed the gate on Exaone tensor names (the guide's own walkthrough)."""
    from vtcore.cli.scaffold import tiny_config

    assert tiny_config(arch)["model_type"] == model_type
