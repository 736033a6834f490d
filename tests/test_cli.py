"""The ``vtcore`` CLI: in-process through ``main(argv, out=...)``, plus one subprocess smoke test per command."""
from __future__ import annotations

import importlib.metadata as md
import io
import json
import os
import subprocess
import sys

import pytest

from vtcore.cli.main import main
from vtcore.config import DEFAULT_MODEL
from vtcore.plugins.manager import Plugins, reset_plugins

TESTS_DIR = os.path.dirname(os.path.abspath(__file__))
REPO_ROOT = os.path.dirname(TESTS_DIR)
HAS_DEFAULT_MODEL = os.path.exists(os.path.join(DEFAULT_MODEL, "model.safetensors"))
needs_default_model = pytest.mark.skipif(not HAS_DEFAULT_MODEL,
                                         reason=f"no embedded default model at {DEFAULT_MODEL} (not trained yet)")
PROMPT = "The best thing about"


@pytest.fixture(autouse=True)
def _real_plugins(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.delenv("VTCORE_PLUGINS", raising=False)
    monkeypatch.delenv("VTCORE_STRICT_PLUGINS", raising=False)
    monkeypatch.syspath_prepend(TESTS_DIR)  # for fixture_plugins
    reset_plugins(None)
    yield
    reset_plugins(None)


def run_cli(*argv: str) -> tuple[int, str]:
    out = io.StringIO()
    return main(list(argv), out=out), out.getvalue()


def fixture_ep(name: str) -> md.EntryPoint:
    return md.EntryPoint(name=name, value=f"fixture_plugins.{name}", group="vtcore")


def subprocess_cli(*argv: str, timeout: float = 120) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith("VTCORE_")}
    return subprocess.run([sys.executable, "-m", "vtcore.cli.main", *argv], capture_output=True, text=True,
                          timeout=timeout, env=env, cwd=REPO_ROOT)


# -------------------------------------------------------------------------------------------- plugins
def test_plugins_lists_qwen3_dense_and_its_hooks() -> None:
    rc, out = run_cli("plugins")
    assert rc == 0
    lines = out.splitlines()
    i = next(i for i, line in enumerate(lines) if line.startswith("qwen3_dense "))
    assert lines[i].split() == ["qwen3_dense", "vtcore-qwen3-dense", "0.1.0"]
    assert lines[i + 1].strip() == "vtcore_model_families, vtcore_tool_parser"
    j = next(i for i, line in enumerate(lines) if line.startswith("vtcore.builtin "))
    assert lines[j + 1].strip() == "vtcore_conformance_example, vtcore_loaders"
    assert "FAILED" not in out


def test_plugins_json() -> None:
    rc, out = run_cli("plugins", "--json")
    assert rc == 0
    entries = {e["name"]: e for e in json.loads(out)}
    assert entries["qwen3_dense"] == {"name": "qwen3_dense", "module": "vtcore_qwen3_dense.plugin",
                                      "dist": "vtcore-qwen3-dense", "version": "0.1.0",
                                      "hooks": ["vtcore_model_families", "vtcore_tool_parser"], "error": None,
                                      "heavy_imports": []}
    assert entries["vtcore.builtin"]["error"] is None
    assert (entries["vtcore.builtin"]["dist"], entries["vtcore.builtin"]["version"]) == \
        ("vtcore", md.version("vtcore"))  # the built-in plugin shows vtcore's own version


def test_plugins_json_reports_a_broken_plugin() -> None:
    reset_plugins(Plugins(entry_points=list(md.entry_points(group="vtcore")) + [fixture_ep("broken_import")]))
    rc, out = run_cli("plugins", "--json")
    assert rc == 1
    entries = {e["name"]: e for e in json.loads(out)}
    error = ("RuntimeError: fixture plugin exploded at import (raised at "
             f"{os.path.join(TESTS_DIR, 'fixture_plugins', 'broken_import.py')}:2 in <module>)")
    assert entries["broken_import"] == {"name": "broken_import", "module": "fixture_plugins.broken_import",
                                        "dist": None, "version": None, "hooks": [], "error": error,
                                        "heavy_imports": []}
    assert entries["qwen3_dense"]["error"] is None
    assert entries["qwen3_dense"]["hooks"] == ["vtcore_model_families", "vtcore_tool_parser"]

    rc, out = run_cli("plugins")
    assert rc == 1
    lines = out.splitlines()
    i = next(i for i, line in enumerate(lines) if line.startswith("broken_import "))
    assert lines[i + 1].strip() == "FAILED: " + error


# --------------------------------------------------------------------------------------------- models
def qwen3_only() -> list[md.EntryPoint]:
    return [e for e in md.entry_points(group="vtcore") if e.name == "qwen3_dense"]


def test_models_maps_qwen3_to_qwen3_dense() -> None:
    reset_plugins(Plugins(entry_points=qwen3_only()))
    rc, out = run_cli("models")
    assert rc == 0
    assert out.splitlines() == [f"{'Qwen3ForCausalLM':<40} family=qwen3_dense plugin=qwen3_dense device-tokens"]


def test_models_shows_conflicts() -> None:
    eps = qwen3_only() + [fixture_ep("clash_a"), fixture_ep("clash_b"), fixture_ep("good_family")]
    reset_plugins(Plugins(entry_points=eps))
    rc, out = run_cli("models")
    assert rc == 0
    assert out.splitlines() == [
        f"{'FixtureForCausalLM':<40} family=fixture_family plugin=good_family",
        f"{'FixtureMoeForCausalLM':<40} family=fixture_family plugin=good_family",
        f"{'Qwen3ForCausalLM':<40} family=qwen3_dense plugin=qwen3_dense device-tokens",
        f"{'ClashForCausalLM':<40} CONFLICT: registered by clash_a, clash_b",
    ]
    rc, out = run_cli("plugins")  # the plugin that loaded first is listed in the conflict too, not as healthy only
    assert rc == 1
    lines = out.splitlines()
    first = lines.index(next(line for line in lines if line.startswith("clash_a ")))
    assert lines[first + 2] == ("    CONFLICT: architecture 'ClashForCausalLM' is registered by clash_a and clash_b; "
                                "it resolves to neither"), lines


# ------------------------------------------------------------------------------------------- generate
def test_generate_text_prompt_without_tokenizer(tiny_checkpoint, capsys: pytest.CaptureFixture) -> None:
    path = tiny_checkpoint[0]
    rc, out = run_cli("generate", "--model", path, "--device", "cpu", "Hello there")
    assert rc == 2
    assert out == ""
    assert capsys.readouterr().err == (f"vtcore generate: error: text prompt given, but the checkpoint {path!r} "
                                       "has no tokenizer; pass {'prompt_token_ids': [...]} instead\n")


def test_generate_chat_without_tokenizer(tiny_checkpoint, capsys: pytest.CaptureFixture) -> None:
    rc, out = run_cli("generate", "--model", tiny_checkpoint[0], "--device", "cpu", "--chat", "Hello")
    assert rc == 2
    assert "tokenizer" in capsys.readouterr().err


def test_generate_on_a_conflicting_architecture(tiny_checkpoint, capsys: pytest.CaptureFixture) -> None:
    reset_plugins(Plugins(entry_points=list(md.entry_points(group="vtcore")) + [fixture_ep("clash_qwen3")]))
    rc, _ = run_cli("generate", "--model", tiny_checkpoint[0], "--device", "cpu", "Hello")
    assert rc == 2
    err = capsys.readouterr().err
    assert "'clash_qwen3'" in err and "'qwen3_dense'" in err


def test_generate_missing_model_folder(tmp_path, capsys: pytest.CaptureFixture) -> None:
    missing = str(tmp_path / "nowhere")
    rc, out = run_cli("generate", "--model", missing, "--device", "cpu", "Hello")
    assert rc == 2
    assert capsys.readouterr().err == (f"vtcore generate: error: model={missing!r}: expected a checkpoint folder "
                                       "with config.json, found none\n")


def test_generate_bad_sampling_flag(tiny_checkpoint, capsys: pytest.CaptureFixture) -> None:
    rc, _ = run_cli("generate", "--model", tiny_checkpoint[0], "--device", "cpu", "--top-p", "0", "Hello")
    assert rc == 2
    assert capsys.readouterr().err.startswith("vtcore generate: error: --top-p=0.0: expected ")  # the flag typed


@needs_default_model
def test_generate_on_the_default_model_in_process() -> None:
    rc, out = run_cli("generate", "--device", "cpu", "--max-tokens", "5", PROMPT)
    assert rc == 0
    assert out.startswith(PROMPT) and out.endswith("\n")
    assert out[len(PROMPT):].strip()  # some generated text after the prompt


@needs_default_model
def test_generate_takes_the_checkpoints_generation_config_under_the_flags(default_model_with) -> None:
    """Flags left out take the checkpoint's generation_config.json values, then the CLI's own
    (greedy, 64 tokens); a flag given wins."""
    from vtcore import LLM, SamplingParams

    path = default_model_with(max_new_tokens=3)
    llm = LLM(path, device="cpu")

    def text(n: int) -> str:
        return PROMPT + llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=n))[0].outputs[0].text + "\n"

    assert run_cli("generate", "--model", path, "--device", "cpu", PROMPT) == (0, text(3))
    assert run_cli("generate", "--model", path, "--device", "cpu", "--max-tokens", "6", PROMPT) == (0, text(6))


def test_cli_refusals_before_any_work(tmp_path, capsys: pytest.CaptureFixture, monkeypatch) -> None:
    """A scaffold named like an installed plugin (installing it would replace it), a --json folder that
    does not exist (it once failed after the whole gate ran), --quant with --no-quant."""
    from vtcore.conformance import gate

    monkeypatch.setattr(gate, "main", lambda *a: pytest.fail("the gate ran"))
    assert run_cli("new-plugin", "qwen3_dense", "--arch", "Qwen3ForCausalLM", "--dir", str(tmp_path))[0] == 2
    assert "NAME='qwen3_dense': a plugin or family of that name is installed" in capsys.readouterr().err
    assert not os.listdir(tmp_path)
    missing = str(tmp_path / "no" / "r.json")
    for command in ("conformance", "bench"):  # bench too ran its whole sweep first
        with pytest.raises(SystemExit):
            run_cli(command, "--json", missing)
        assert f"--json {missing!r}: its folder does not exist" in capsys.readouterr().err
    with pytest.raises(SystemExit):  # a folder itself: refused before the run too
        run_cli("bench", "--json", str(tmp_path))
    assert f"--json {str(tmp_path)!r}: a folder; expected a file's path" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        run_cli("conformance", "--no-quant", "--quant", "nvfp4-pack-quantized")
    assert "not allowed with argument --no-quant" in capsys.readouterr().err
    with pytest.raises(SystemExit):  # (SamplingParams' message offered None, which no flag can pass)
        run_cli("generate", "--max-tokens", "-1", "Hi")
    assert "--max-tokens='-1': expected an integer >= 0" in capsys.readouterr().err


# ------------------------------------------------------------------------------ subprocess smoke tests
def test_subprocess_plugins() -> None:
    proc = subprocess_cli("plugins")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split()[:2] == ["vtcore.builtin", "vtcore"]
    assert "qwen3_dense" in proc.stdout and "vtcore_model_families" in proc.stdout


def test_subprocess_models() -> None:
    proc = subprocess_cli("models")
    assert proc.returncode == 0, proc.stderr
    assert "Qwen3ForCausalLM" in proc.stdout and "family=qwen3_dense plugin=qwen3_dense" in proc.stdout


@needs_default_model
def test_subprocess_generate_on_the_default_model() -> None:
    proc = subprocess_cli("generate", "--device", "cpu", "--max-tokens", "8", PROMPT, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith(PROMPT)
    assert proc.stdout[len(PROMPT):].strip()
