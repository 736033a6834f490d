"""Guarded plugin loading: broken plugins are reported by name while the others load and serve.

The fixture plugins live in ``tests/fixture_plugins`` and are loaded through hand-made entry
points (``fixture_plugins.<module>``, with ``tests/`` on ``sys.path``) next to the real entry
points installed in this environment (``qwen3_dense``).
"""
from __future__ import annotations

import argparse
import importlib
import importlib.metadata as md
import io
import json
import logging
import os
import subprocess
import sys
import types

import pytest

from vtcore.errors import PluginError, UnknownArchitectureError
from vtcore.family import ConformanceExample, ModelFamily
from vtcore.plugins.manager import BUILTIN_NAME, Plugins, get_plugins, reset_plugins

TESTS_DIR = os.path.dirname(os.path.abspath(__file__))


@pytest.fixture(autouse=True)
def _isolated_plugins(monkeypatch: pytest.MonkeyPatch):
    """No plugin env vars leak in, fixture plugins are importable, the global manager is restored."""
    monkeypatch.delenv("VTCORE_STRICT_PLUGINS", raising=False)
    monkeypatch.delenv("VTCORE_PLUGINS", raising=False)
    monkeypatch.syspath_prepend(TESTS_DIR)
    reset_plugins(None)
    yield
    reset_plugins(None)


def raised_at(module: str, line: int, function: str = "<module>") -> str:
    """The location a load error names: the fixture plugin's own line."""
    return f" (raised at {os.path.join(TESTS_DIR, 'fixture_plugins', module + '.py')}:{line} in {function})"


def fixture_ep(name: str, module: str | None = None) -> md.EntryPoint:
    """An entry point named ``name`` whose value is the fixture module ``module`` (default: ``name``)."""
    return md.EntryPoint(name=name, value=f"fixture_plugins.{module or name}", group="vtcore")


def real_eps() -> list[md.EntryPoint]:
    """The installed qwen3_dense entry point: the known baseline (other installed plugins left out)."""
    eps = [e for e in md.entry_points(group="vtcore") if e.name == "qwen3_dense"]
    assert eps, "the qwen3_dense plugin must be installed for these tests"
    return eps


def assert_qwen3_fine(plugins: Plugins) -> None:
    info = plugins.infos["qwen3_dense"]
    assert info.error is None
    assert info.hooks == ["vtcore_model_families", "vtcore_tool_parser"]
    assert info.dist == "vtcore-qwen3-dense"
    fam = plugins.family_for("Qwen3ForCausalLM")
    assert (fam.name, fam.plugin, fam.consumes_device_tokens) == ("qwen3_dense", "qwen3_dense", True)
    assert plugins.pm.get_plugin("qwen3_dense") is not None
    assert plugins.infos[BUILTIN_NAME].error is None
    assert {"auto", "safetensors", "dummy"} <= set(plugins.loaders)


def assert_good_family_fine(plugins: Plugins, name: str = "good_family") -> None:
    assert plugins.infos[name].error is None
    assert plugins.infos[name].hooks == ["vtcore_loaders", "vtcore_model_families"]
    for arch in ("FixtureForCausalLM", "FixtureMoeForCausalLM"):
        fam = plugins.family_for(arch)
        assert (fam.name, fam.plugin) == ("fixture_family", name)
    assert plugins.loaders["fixture_format"] == (name, "fixture_plugins.good_family:load_nothing")


# ---------------------------------------------------------------------------------------- load errors
def test_import_error_is_reported_while_others_load(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="vtcore.plugins"):
        plugins = Plugins(entry_points=real_eps() + [fixture_ep("broken_import"), fixture_ep("good_family")])
    info = plugins.infos["broken_import"]
    error = "RuntimeError: fixture plugin exploded at import" + raised_at("broken_import", 2)
    assert info.error == error
    assert info.module == "fixture_plugins.broken_import"
    assert info.hooks == []
    assert plugins.errors == {"broken_import": error}
    assert plugins.pm.get_plugin("broken_import") is None
    # the failure is logged in one line naming the plugin, the exception and where the plugin raised it
    lines = [r.getMessage() for r in caplog.records if r.name == "vtcore.plugins"]
    assert lines == ["vtcore: plugin 'broken_import' failed to load: " + error]
    assert_qwen3_fine(plugins)
    assert_good_family_fine(plugins)


def test_entry_point_that_is_not_a_module_is_reported() -> None:
    ep = md.EntryPoint(name="not_a_module", value="fixture_plugins.good_family:vtcore_model_families",
                       group="vtcore")
    plugins = Plugins(entry_points=real_eps() + [ep])
    assert plugins.errors == {"not_a_module": "PluginError: entry point "
                              "'fixture_plugins.good_family:vtcore_model_families' is function, expected a module"}
    assert_qwen3_fine(plugins)


def test_a_bad_hook_signature_is_reported_in_one_line() -> None:
    """pluggy's signature error spans three lines; ``vtcore plugins`` promises one per plugin."""
    plugins = Plugins(entry_points=real_eps() + [fixture_ep("bad_signature")])
    error = plugins.errors["bad_signature"]
    assert error.startswith("PluginValidationError: ") and "not_an_argument" in error and "\n" not in error
    assert_qwen3_fine(plugins)


@pytest.mark.parametrize("name", ["a_misspelled", "zz_misspelled"])  # loaded before / after the others
def test_misspelled_hook_is_reported(name: str) -> None:
    plugins = Plugins(entry_points=real_eps() + [fixture_ep(name, "misspelled_hook"), fixture_ep("good_family")])
    error = plugins.infos[name].error
    assert error is not None and error.startswith("PluginValidationError: ")
    assert "unknown hook 'vtcore_model_familes'" in error
    assert set(plugins.errors) == {name}
    assert plugins.pm.get_plugin(name) is None
    assert "misspelled" not in plugins.families
    assert "MisspelledForCausalLM" not in plugins.architectures
    assert_qwen3_fine(plugins)
    assert_good_family_fine(plugins)
    plugins.pm.check_pending()  # the failed plugin left nothing pending behind


@pytest.mark.parametrize("module, expected", [
    ("bad_registration", "PluginError: vtcore_model_families returned {'name': 'not_a_family', "
                         "'architectures': ['BadRegForCausalLM']}, expected a list of ModelFamily"),
    ("bad_loaders", "PluginError: vtcore_loaders returned {'fixture_bad_loader': 42}, "
                    "expected a dict of name -> 'module:attr'"),
    ("bad_family_ref", "PluginError: vtcore_model_families raised ValueError: "
                       "model_cls='fixture_plugins.bad_family_ref.NoColonHere': expected a lazy reference "
                       "'package.module:Name'" + raised_at("bad_family_ref", 8, "vtcore_model_families")),
])
def test_bad_registration_is_reported(module: str, expected: str) -> None:
    plugins = Plugins(entry_points=[fixture_ep(module)] + real_eps() + [fixture_ep("good_family")])
    assert plugins.errors == {module: expected}
    assert plugins.infos[module].hooks == []  # nothing of it is registered
    assert plugins.pm.get_plugin(module) is None
    assert "fixture_bad_loader" not in plugins.loaders
    assert not {"BadRegForCausalLM", "BadRefForCausalLM"} & set(plugins.architectures)
    assert not {"not_a_family", "bad_ref"} & set(plugins.families)
    assert_qwen3_fine(plugins)
    assert_good_family_fine(plugins)


def test_a_plugin_importing_a_heavy_module_at_registration_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    """Registration must stay cheap (a plugin module importing torch made every command's start 3 s slower): the
    plugin that first imports a heavy module is named by ``vtcore plugins``, and still loads."""
    from vtcore.cli.main import cmd_plugins
    from vtcore.plugins.manager import use_plugins

    monkeypatch.setattr("vtcore.plugins.manager.HEAVY_MODULES", ("fixture_plugins._heavy_dep",))
    for name in ("fixture_plugins._heavy_dep", "fixture_plugins.heavy_import"):
        monkeypatch.delitem(sys.modules, name, raising=False)
    plugins = Plugins(entry_points=real_eps() + [fixture_ep("heavy_import"), fixture_ep("good_family")])
    assert plugins.infos["heavy_import"].heavy_imports == ["fixture_plugins._heavy_dep"]
    assert plugins.infos["heavy_import"].error is None
    assert plugins.infos["good_family"].heavy_imports == [] == plugins.infos["qwen3_dense"].heavy_imports
    out = io.StringIO()
    with use_plugins(plugins):
        assert cmd_plugins(argparse.Namespace(json=False), out) == 0
    assert ("heavy_import         - \n    vtcore_model_families\n    SLOW: imports fixture_plugins._heavy_dep while "
            "registering; keep its entry point's module light (import the model where model_cls names it)\n"
            ) in out.getvalue(), out.getvalue()


# ------------------------------------------------------------------------------------------ clashes
def test_two_fixture_plugins_registering_one_architecture() -> None:
    plugins = Plugins(entry_points=real_eps() + [fixture_ep("clash_a"), fixture_ep("clash_b")])
    assert plugins.errors == {"clash_b": (
        "PluginError: architecture 'ClashForCausalLM' is registered by both 'clash_a' and 'clash_b'; "
        "it resolves to neither until one is uninstalled (or excluded with VTCORE_PLUGINS)")}
    assert plugins.conflicts == {"ClashForCausalLM": ["clash_a", "clash_b"]}
    assert "ClashForCausalLM" not in plugins.architectures
    with pytest.raises(PluginError) as exc:
        plugins.family_for("ClashForCausalLM")
    assert str(exc.value) == ("architecture 'ClashForCausalLM' is registered by both 'clash_a' and 'clash_b'; "
                              "uninstall one or narrow VTCORE_PLUGINS")
    assert_qwen3_fine(plugins)


@pytest.mark.parametrize("name", ["clash_qwen3", "zz_clash_qwen3"])  # loaded before / after qwen3_dense
def test_plugin_clashing_with_qwen3_dense(name: str) -> None:
    plugins = Plugins(entry_points=real_eps() + [fixture_ep(name, "clash_qwen3")])
    first, second = sorted([name, "qwen3_dense"])
    assert plugins.conflicts == {"Qwen3ForCausalLM": [first, second]}
    assert list(plugins.errors) == [second]
    assert f"'Qwen3ForCausalLM' is registered by both '{first}' and '{second}'" in plugins.errors[second]
    assert plugins.infos[first].error is None
    with pytest.raises(PluginError) as exc:
        plugins.family_for("Qwen3ForCausalLM")
    assert f"architecture 'Qwen3ForCausalLM' is registered by both '{first}' and '{second}'" in str(exc.value)
    if second == "qwen3_dense":  # its family never registered: asked for by name, the error says why
        with pytest.raises(UnknownArchitectureError) as exc:
            plugins.family("qwen3_dense")
        assert str(exc.value).endswith(f"plugins that did not load: qwen3_dense ({plugins.errors['qwen3_dense']})")
    # narrowing VTCORE_PLUGINS is the way out: only one of them remains
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("VTCORE_PLUGINS", "qwen3_dense")
        narrowed = Plugins(entry_points=real_eps() + [fixture_ep(name, "clash_qwen3")])
    assert narrowed.errors == {} and narrowed.family_for("Qwen3ForCausalLM").plugin == "qwen3_dense"


def test_a_plugin_cannot_take_over_another_plugins_loader() -> None:
    """Loader and quant-format names clash like architectures: a second plugin registering
    'safetensors' once silently replaced the built-in loader for every checkpoint."""
    plugins = Plugins(entry_points=real_eps() + [fixture_ep("takeover")])
    assert plugins.errors == {"takeover": (
        f"PluginError: load format 'safetensors' is registered by both {BUILTIN_NAME!r} and 'takeover'; a plugin may "
        "not replace another's (uninstall one or narrow VTCORE_PLUGINS)")}
    assert plugins.loaders["safetensors"][0] == BUILTIN_NAME and "takeover_format" not in plugins.loaders
    assert_qwen3_fine(plugins)


def test_two_plugins_under_one_entry_point_name() -> None:
    """The first keeps the name and loads; the second is reported under its own row (it once
    replaced the first's row, which then showed the second's pluggy error, and its family vanished)."""
    plugins = Plugins(entry_points=real_eps() + [fixture_ep("dup", "good_family"), fixture_ep("dup", "clash_a")])
    assert plugins.errors == {"dup [fixture_plugins.clash_a]": (
        "PluginError: entry point name 'dup' is used by both 'fixture_plugins.good_family' and "
        "'fixture_plugins.clash_a'; only the first is loaded (uninstall one)")}
    assert_good_family_fine(plugins, "dup")
    assert "ClashForCausalLM" not in plugins.architectures
    assert_qwen3_fine(plugins)


def test_a_plugin_exiting_at_import_and_malformed_entry_points_are_reported() -> None:
    """sys.exit() at a plugin's import once ended every vtcore command; a malformed entry-point value
    read "'NoneType' object has no attribute 'group'"."""
    plugins = Plugins(entry_points=real_eps() + [fixture_ep("exits"),
                                                 md.EntryPoint(name="malformed", value="not a module", group="vtcore")])
    assert plugins.errors == {
        "exits": "SystemExit: this plugin exits at import" + raised_at("exits", 4),
        "malformed": "PluginError: entry point value 'not a module': expected an importable module path such as "
                     "'my_plugin.plugin'"}
    assert_qwen3_fine(plugins)


def test_allow_list_naming_a_plugin_that_is_not_installed(monkeypatch: pytest.MonkeyPatch,
                                                          caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setenv("VTCORE_PLUGINS", "qwen3_dense,no_such_plugin")
    with caplog.at_level(logging.WARNING, logger="vtcore.plugins"):
        plugins = Plugins(entry_points=real_eps())
    error = "PluginError: VTCORE_PLUGINS names 'no_such_plugin', which no installed package provides (installed: " \
            "['qwen3_dense'])"
    assert plugins.errors == {"no_such_plugin": error}
    # logged as a failed plugin is (every command says it on stderr, not only ``vtcore plugins``)
    assert [r.getMessage() for r in caplog.records if r.name == "vtcore.plugins"] == ["vtcore: " + error]
    assert_qwen3_fine(plugins)


def test_a_plugin_registering_an_architecture_twice_itself_is_reported() -> None:
    plugins = Plugins(entry_points=real_eps() + [fixture_ep("self_dup")])
    assert plugins.errors == {"self_dup": "PluginError: architecture 'SelfDupForCausalLM' is registered twice by "
                                          "'self_dup' itself"}
    assert not {"self_dup_a", "self_dup_b"} & set(plugins.families)
    assert_qwen3_fine(plugins)


def test_plugin_failing_on_a_clash_registers_nothing_else() -> None:
    plugins = Plugins(entry_points=real_eps() + [fixture_ep("zz_clash_plus", "clash_plus")])
    assert list(plugins.errors) == ["zz_clash_plus"]
    assert plugins.pm.get_plugin("zz_clash_plus") is None
    assert "clash_plus_format" not in plugins.loaders
    assert "clash_plus" not in plugins.families
    with pytest.raises(UnknownArchitectureError):
        plugins.family_for("ClashPlusForCausalLM")


# ------------------------------------------------------------------------------ unknown architecture
def test_unknown_architecture_names_it_and_lists_supported_by_plugin() -> None:
    plugins = Plugins(entry_points=real_eps() + [fixture_ep("good_family")])
    with pytest.raises(UnknownArchitectureError) as exc:
        plugins.family_for("FooForCausalLM")
    assert isinstance(exc.value, ValueError)
    assert str(exc.value) == (
        "architecture 'FooForCausalLM' is not supported. Supported, by plugin: "
        "good_family: FixtureForCausalLM, FixtureMoeForCausalLM; qwen3_dense: Qwen3ForCausalLM. "
        "To serve it: install a vtcore plugin that registers it "
        "(docs/writing-a-plugin.md shows how to write one).")


@pytest.mark.parametrize("arch", ["Qwen3_5ForCausalLM", "Qwen3_5MoeForConditionalGeneration"])
def test_unknown_first_party_architecture_says_what_to_install(arch: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("vtcore.plugins.manager._installed", lambda dist: False)  # (vtcore-qwen3-5 is, here)
    plugins = Plugins(entry_points=real_eps())
    with pytest.raises(UnknownArchitectureError) as exc:
        plugins.family_for(arch)
    msg = str(exc.value)
    assert f"architecture {arch!r} is not supported" in msg
    assert "Supported, by plugin: qwen3_dense: Qwen3ForCausalLM." in msg
    assert msg.endswith("To serve it: pip install vtcore-qwen3-5.")


def test_no_model_plugin_loaded(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("vtcore.plugins.manager._installed", lambda dist: False)
    plugins = Plugins(entry_points=[])
    assert list(plugins.infos) == [BUILTIN_NAME]
    with pytest.raises(UnknownArchitectureError) as exc:
        plugins.family_for("Qwen3ForCausalLM")
    assert "Supported, by plugin: none (no model plugin loaded)" in str(exc.value)
    assert "pip install vtcore-qwen3-dense" in str(exc.value)
    with pytest.raises(UnknownArchitectureError, match="model family 'qwen3_dense' is not registered"):
        plugins.family("qwen3_dense")


# ------------------------------------------------------------------------------------ env switches
@pytest.mark.parametrize("module, cause, text", [
    ("broken_import", RuntimeError, "plugin 'broken_import' failed to load: "
                                    "RuntimeError: fixture plugin exploded at import"),
    ("misspelled_hook", Exception, "unknown hook 'vtcore_model_familes'"),
    ("bad_registration", PluginError, "plugin 'bad_registration' failed to load: "
                                      "PluginError: vtcore_model_families returned"),
])
def test_strict_mode_reraises(monkeypatch: pytest.MonkeyPatch, module: str, cause: type, text: str) -> None:
    monkeypatch.setenv("VTCORE_STRICT_PLUGINS", "1")
    with pytest.raises(PluginError) as exc:
        Plugins(entry_points=real_eps() + [fixture_ep(module)])
    assert text in str(exc.value)
    assert f"plugin {module!r} failed to load" in str(exc.value)
    assert isinstance(exc.value.__cause__, cause)
    # strict mode does not reject healthy plugins
    assert_good_family_fine(Plugins(entry_points=real_eps() + [fixture_ep("good_family")]))


def test_strict_mode_zero_means_off(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("VTCORE_STRICT_PLUGINS", "0")
    plugins = Plugins(entry_points=real_eps() + [fixture_ep("broken_import")])
    assert set(plugins.errors) == {"broken_import"}


def test_allow_list_loads_only_the_named(monkeypatch: pytest.MonkeyPatch) -> None:
    eps = real_eps() + [fixture_ep("broken_import"), fixture_ep("good_family"), fixture_ep("clash_qwen3")]
    monkeypatch.setenv("VTCORE_PLUGINS", " good_family , qwen3_dense")
    plugins = Plugins(entry_points=eps)
    assert set(plugins.infos) == {BUILTIN_NAME, "good_family", "qwen3_dense"}
    assert plugins.errors == {} and plugins.conflicts == {}
    assert_qwen3_fine(plugins)
    assert_good_family_fine(plugins)

    monkeypatch.setenv("VTCORE_PLUGINS", "good_family")
    plugins = Plugins(entry_points=eps)
    assert set(plugins.infos) == {BUILTIN_NAME, "good_family"}
    with pytest.raises(UnknownArchitectureError) as exc:  # (an installed plugin left out: no "pip install")
        plugins.family_for("Qwen3ForCausalLM")
    assert str(exc.value).endswith(
        "VTCORE_PLUGINS leaves out the installed plugins ['broken_import', 'clash_qwen3', 'qwen3_dense']. "
        "To serve it: vtcore-qwen3-dense is installed: let VTCORE_PLUGINS load its plugin.")


def test_unknown_architecture_names_the_plugin_that_did_not_load(monkeypatch: pytest.MonkeyPatch) -> None:
    """The family's plugin is installed but failed at import (``vtcore generate`` once said only "install a plugin
    that registers it"): the error names the failure, and the hint does not send the user to pip."""
    module = "fixture_plugins.broken_import"  # (as the installed distribution's own entry point, failing)
    broken = types.SimpleNamespace(name="qwen3_dense", value=module, dist=real_eps()[0].dist,
                                   load=lambda: importlib.import_module(module))
    plugins = Plugins(entry_points=[broken])
    with pytest.raises(UnknownArchitectureError) as exc:
        plugins.family_for("Qwen3ForCausalLM")
    assert str(exc.value).endswith(
        "Plugins that did not load: qwen3_dense (RuntimeError: fixture plugin exploded at import"
        + raised_at("broken_import", 2) + "). To serve it: vtcore-qwen3-dense is installed, but its plugin did not "
        "load (above).")


def test_allow_list_applies_to_the_process_wide_manager(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("VTCORE_PLUGINS", "no_such_plugin")
    reset_plugins(None)
    assert set(get_plugins().infos) == {BUILTIN_NAME, "no_such_plugin"}  # the unknown name reported
    assert list(get_plugins().errors) == ["no_such_plugin"] and not get_plugins().families
    monkeypatch.delenv("VTCORE_PLUGINS")
    reset_plugins(None)
    assert_qwen3_fine(get_plugins())


# --------------------------------------------------------------------------- ModelFamily validation
@pytest.mark.parametrize("kwargs, text", [
    (dict(model_cls="vtcore_qwen3_dense.model.Qwen3ForCausalLM"),
     "model_cls='vtcore_qwen3_dense.model.Qwen3ForCausalLM': expected a lazy reference 'package.module:Name'"),
    (dict(model_cls="pkg.mod:"), "model_cls='pkg.mod:'"),
    (dict(conformance_example="not a ref"), "conformance_example='not a ref': expected a lazy reference"),
    (dict(architectures=()), "architectures=(): expected a non-empty tuple of HF architecture names"),
    (dict(architectures=[]), "architectures=[]: expected a non-empty tuple"),
    (dict(architectures=("Qwen3ForCausalLM", "")), "architectures=('Qwen3ForCausalLM', '')"),
    (dict(architectures=("Qwen3ForCausalLM", 3)), "architectures=('Qwen3ForCausalLM', 3)"),
])
def test_model_family_validation_names_the_value(kwargs: dict, text: str) -> None:
    args = dict(name="f", architectures=("Qwen3ForCausalLM",), model_cls="vtcore_qwen3_dense.model:Qwen3ForCausalLM")
    with pytest.raises(ValueError) as exc:
        ModelFamily(**{**args, **kwargs})
    assert text in str(exc.value)


def test_model_family_rejects_a_bare_string_of_architectures() -> None:
    with pytest.raises(ValueError, match="architectures="):
        ModelFamily(name="f", architectures="Qwen3ForCausalLM", model_cls="vtcore_qwen3_dense.model:Qwen3ForCausalLM")


def test_model_family_rejects_model_cls_none() -> None:
    with pytest.raises(ValueError, match="model_cls=None"):
        ModelFamily(name="f", architectures=("Qwen3ForCausalLM",), model_cls=None)


def test_conformance_example_validation_names_the_oracle() -> None:
    with pytest.raises(ValueError, match=r"oracle='transformers\.Qwen3ForCausalLM': expected a lazy reference"):
        ConformanceExample(hf_config={}, oracle="transformers.Qwen3ForCausalLM")


# ----------------------------------------------------------------------------------- import cost
def test_import_vtcore_and_loading_plugins_stays_light() -> None:
    code = (
        "import json, sys\n"
        "heavy = ('torch', 'transformers', 'triton')\n"
        "def loaded(): return sorted(m for m in sys.modules if m.split('.')[0] in heavy)\n"
        "import vtcore\n"
        "after_import = loaded()\n"
        "from vtcore.plugins.manager import get_plugins\n"
        "p = get_plugins()\n"
        "print(json.dumps({'import': after_import, 'plugins': loaded(), 'errors': p.errors,\n"
        "                  'archs': sorted(p.architectures)}))\n"
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("VTCORE_")}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, env=env)
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["import"] == []
    assert result["plugins"] == []  # registering a family costs no torch import
    assert result["errors"] == {}
    assert "Qwen3ForCausalLM" in result["archs"]


# --------------------------------------------------------------------------- model-build hooks
GREEDY_PROMPTS = [{"prompt_token_ids": [1, 2, 3]}, {"prompt_token_ids": [7, 300, 42, 5, 11]}]


def _generate(path: str, max_tokens: int = 4):
    from vtcore import LLM, SamplingParams

    llm = LLM(path, device="cpu", num_kv_blocks=8, block_size=16)
    outs = llm.generate(GREEDY_PROMPTS, SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True))
    return llm, [o.outputs[0].token_ids for o in outs]


def test_plugin_code_failing_at_model_build_is_named(tiny_checkpoint, tmp_path) -> None:
    """Plugin code that runs when a model is built (the family's model class, a vtcore_embed_into
    hook) fails with an error naming the family and the plugin, not a bare traceback."""
    import shutil

    from vtcore import LLM

    reset_plugins(Plugins(entry_points=real_eps() + [fixture_ep("missing_cls")]))
    path = str(tmp_path / "ckpt")
    shutil.copytree(tiny_checkpoint[0], path)
    with open(os.path.join(path, "config.json")) as f:
        cfg = json.load(f)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump({**cfg, "architectures": ["MissingClsForCausalLM"]}, f)
    with pytest.raises(PluginError) as exc:
        LLM(path, device="cpu", load_format="dummy")
    assert str(exc.value).startswith("model family 'missing_cls' (plugin 'missing_cls'): model_cls "
                                     "'fixture_plugins.no_such_module:Model' cannot be imported: ModuleNotFoundError")
    reset_plugins(Plugins(entry_points=real_eps() + [fixture_ep("raising_embed")]))
    with pytest.raises(PluginError) as exc:
        LLM(tiny_checkpoint[0], device="cpu")
    assert str(exc.value) == ("vtcore_embed_into (implemented by ['raising_embed']) raised building family "
                              "'qwen3_dense': RuntimeError: embed hook blew up")


def test_embed_into_hook_is_applied_once_per_model_build(tiny_checkpoint) -> None:
    from fixture_plugins import counting_embed

    from vtcore.layers.embedding import EmbedInto

    path, _ = tiny_checkpoint
    reset_plugins(Plugins(entry_points=real_eps()))
    _, expected = _generate(path)

    counting_embed.reset()
    plugins = Plugins(entry_points=real_eps() + [fixture_ep("counting_embed")])
    assert plugins.errors == {}
    assert plugins.infos["counting_embed"].hooks == ["vtcore_embed_into"]
    reset_plugins(plugins)
    llm, got = _generate(path)
    model = llm.engine.runner.model
    embed = model.model.embed_tokens
    assert type(embed).__name__ == "CountingEmbedInto"
    assert [m for m in model.modules() if isinstance(m, EmbedInto)] == [embed]
    assert embed.family == "qwen3_dense"
    assert counting_embed.CALLS["hook"] == 1  # once per build, never per step
    # both prompts fit one prefill step, then 3 decode steps: one embedding call per forward
    assert counting_embed.CALLS["forward"] == 4
    assert got == expected  # the wrapper shares the weight, so the weights loaded into it

    _generate(path)
    assert counting_embed.CALLS["hook"] == 2  # a second build applies the hook once more


def test_embed_into_wrapper_keeps_tied_embeddings(make_checkpoint) -> None:
    from fixture_plugins import counting_embed

    path, _ = make_checkpoint(tie_word_embeddings=True)
    reset_plugins(Plugins(entry_points=real_eps()))
    _, expected = _generate(path)
    counting_embed.reset()
    reset_plugins(Plugins(entry_points=real_eps() + [fixture_ep("counting_embed")]))
    llm, got = _generate(path)
    model = llm.engine.runner.model
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert got == expected
    assert counting_embed.CALLS == {"hook": 1, "forward": 4}


def test_embed_into_replacement_is_installed_before_weights_load(tiny_checkpoint) -> None:
    """A plugin may supply a fresh EmbedInto: the checkpoint's embedding loads into it."""
    from fixture_plugins import fresh_embed

    path, _ = tiny_checkpoint
    reset_plugins(Plugins(entry_points=real_eps()))
    _, expected = _generate(path)
    fresh_embed.CALLS["hook"] = 0
    reset_plugins(Plugins(entry_points=real_eps() + [fixture_ep("fresh_embed")]))
    _, got = _generate(path)
    assert fresh_embed.CALLS["hook"] == 1
    assert got == expected


def test_supplied_embed_into_on_tied_checkpoint(make_checkpoint) -> None:
    path, _ = make_checkpoint(tie_word_embeddings=True)
    reset_plugins(Plugins(entry_points=real_eps()))
    _, expected = _generate(path)
    reset_plugins(Plugins(entry_points=real_eps() + [fixture_ep("fresh_embed")]))
    llm, got = _generate(path)
    model = llm.engine.runner.model
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert got == expected


def test_device_token_scope_hook_wraps_every_forward(tiny_checkpoint) -> None:
    from fixture_plugins import counting_embed, counting_scope

    path, _ = tiny_checkpoint
    counting_embed.reset()
    counting_scope.reset()
    plugins = Plugins(entry_points=real_eps() + [fixture_ep("counting_embed"), fixture_ep("counting_scope")])
    assert plugins.errors == {}
    assert plugins.infos["counting_scope"].hooks == ["vtcore_device_token_scope"]
    reset_plugins(plugins)
    llm, _ = _generate(path, max_tokens=6)
    assert counting_scope.CALLS["hook"] == 1  # once, when the runner is built
    assert counting_scope.CALLS["families"] == ["qwen3_dense"]
    assert llm.engine.runner.scope.__name__ == "counting"
    # one scope per forward: 1 prefill + 5 decode steps, and every forward embedded inside it
    assert counting_scope.CALLS["enter"] == counting_scope.CALLS["exit"] == 6
    assert counting_embed.CALLS["forward"] == 6

    # stepping the engine by hand: exactly one scope per submitted batch (async needs one more
    # step() call to collect the last batch's tokens)
    from vtcore import SamplingParams

    engine = llm.engine
    engine.add_request("x", {"prompt_token_ids": [9, 8, 7]}, SamplingParams(temperature=0.0, max_tokens=3))
    steps = 0
    while engine.has_unfinished_requests():
        engine.step()
        steps += 1
    assert steps == 3 + engine.depth - 1
    assert counting_scope.CALLS["enter"] == counting_embed.CALLS["forward"] == 9
