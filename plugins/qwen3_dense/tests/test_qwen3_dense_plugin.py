"""The plugin as installed: found through its entry point, its family and example well formed."""
from __future__ import annotations

import importlib.metadata as md

from vtcore.plugins.manager import Plugins


def test_entry_point_registers_the_family() -> None:
    eps = [ep for ep in md.entry_points(group="vtcore") if ep.name == "qwen3_dense"]
    assert eps and eps[0].value == "vtcore_qwen3_dense.plugin"
    plugins = Plugins(entry_points=eps)
    assert plugins.errors == {}
    family = plugins.family_for("Qwen3ForCausalLM")
    assert family.plugin == "qwen3_dense" and family.consumes_device_tokens
    assert family.load_class().__name__ == "Qwen3ForCausalLM"


def test_conformance_example_builds_its_oracle() -> None:
    plugins = Plugins(entry_points=[ep for ep in md.entry_points(group="vtcore") if ep.name == "qwen3_dense"])
    family = plugins.family("qwen3_dense")
    example = plugins.pm.hook.vtcore_conformance_example(family=family)
    assert example.hf_config["architectures"] == ["Qwen3ForCausalLM"]
    from vtcore.testing.oracle import hf_model

    model = hf_model(example.hf_config)
    assert type(model).__name__ == example.oracle.split(":")[1]
    assert example.hf_config["num_hidden_layers"] >= 2
