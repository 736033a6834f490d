"""Shared fixtures: tiny Qwen3 configs and their HF checkpoints (built once per session)."""
from __future__ import annotations

import hashlib
import json
from typing import TYPE_CHECKING, Any, Callable

import pytest

from vtcore.testing.oracle import tiny_config

if TYPE_CHECKING:
    from vtcore.plugins.manager import Plugins



@pytest.fixture(autouse=True)
def _real_plugins(monkeypatch: pytest.MonkeyPatch):
    """Every test starts from the installed plugins, with no allow-list or strict mode leaking in."""
    from vtcore.plugins.manager import reset_plugins

    monkeypatch.delenv("VTCORE_PLUGINS", raising=False)
    monkeypatch.delenv("VTCORE_STRICT_PLUGINS", raising=False)
    reset_plugins(None)
    yield
    reset_plugins(None)


@pytest.fixture(scope="module")
def plugins() -> Plugins:
    """The installed plugins and ``tests/fixture_async``'s families, each breaking one part of the contract."""
    import importlib.metadata as md
    import os
    import sys

    from vtcore.plugins.manager import Plugins

    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    return Plugins(entry_points=[*md.entry_points(group="vtcore"), md.EntryPoint(
        name="fixture_async", value="tests.fixture_async.families", group="vtcore")])


@pytest.fixture(scope="session")
def make_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Callable[..., tuple[str, Any]]:
    """``make_checkpoint(**overrides) -> (path, hf_model)``: a saved random HF model, cached per config."""
    from vtcore.testing.oracle import hf_model, save_checkpoint

    cache: dict[str, tuple[str, Any]] = {}

    def make(seed: int = 0, **overrides: Any) -> tuple[str, Any]:
        cfg = tiny_config(**overrides)
        key = hashlib.sha1(json.dumps([cfg, seed], sort_keys=True).encode()).hexdigest()[:12]
        if key not in cache:
            model = hf_model(cfg, seed)
            cache[key] = (save_checkpoint(model, str(tmp_path_factory.mktemp(f"ckpt-{key}"))), model)
        return cache[key]

    return make


@pytest.fixture(scope="session")
def tiny_checkpoint(make_checkpoint: Callable[..., tuple[str, Any]]) -> tuple[str, Any]:
    """The default tiny Qwen3 checkpoint (untied, GQA 2) and its HF model."""
    return make_checkpoint()


@pytest.fixture
def default_model_with(tmp_path) -> Callable[..., str]:
    """``default_model_with(**keys) -> path``: a copy of the embedded default model whose generation_config.json
    also sets ``keys`` (``max_new_tokens``, ``temperature``, ...)."""
    import os
    import shutil

    from vtcore.config import DEFAULT_MODEL

    def make(**keys: Any) -> str:
        path = str(tmp_path / "model")
        shutil.copytree(DEFAULT_MODEL, path)
        config = os.path.join(path, "generation_config.json")
        with open(config) as f:
            gen = json.load(f)
        with open(config, "w") as f:
            json.dump({**gen, **keys}, f)
        return path

    return make
