"""Guarded, one-at-a-time plugin loading and the registries the plugins fill.

Every entry point of the group ``vtcore`` is loaded on its own: a plugin that fails to import,
implements a hook that has no spec, or registers something invalid is recorded with its error
(and logged in one line) while the others load. ``VTCORE_STRICT_PLUGINS=1`` re-raises instead;
``VTCORE_PLUGINS=a,b`` loads only the entry points named.
"""
from __future__ import annotations

import importlib
import importlib.metadata as md
import logging
import os
import re
import sys
import sysconfig
import types
from contextlib import contextmanager
from typing import Any, Callable, Iterable, Iterator

import attrs
import pluggy

from vtcore.errors import PluginError, UnknownArchitectureError, raised_at
from vtcore.family import ModelFamily, resolve_ref
from vtcore.plugins import hookspecs

log = logging.getLogger("vtcore.plugins")

ENTRY_POINT_GROUP = "vtcore"
BUILTIN_NAME = "vtcore.builtin"

#: Which first-party distribution serves which architectures, for the "what to install" hint.
FIRST_PARTY_PACKAGES: dict[str, tuple[str, ...]] = {
    "vtcore-qwen3-dense": ("Qwen3ForCausalLM",),
    "vtcore-qwen3-5": (
        "Qwen3_5ForCausalLM",
        "Qwen3_5MoeForCausalLM",
        "Qwen3_5ForConditionalGeneration",
        "Qwen3_5MoeForConditionalGeneration",
    ),
}


@attrs.define
class PluginInfo:
    """One loaded (or failed) plugin, as ``vtcore plugins`` shows it."""

    name: str
    module: str
    dist: str | None = None
    version: str | None = None
    hooks: list[str] = attrs.Factory(list)
    error: str | None = None
    #: of ``HEAVY_MODULES``, those first imported while this plugin loaded (registration must stay cheap)
    heavy_imports: list[str] = attrs.Factory(list)


#: modules that take seconds to import: a plugin's registration module must not (``vtcore plugins`` and every
#: command's start load them all); one that does is named by ``vtcore plugins``
HEAVY_MODULES = ("torch", "transformers", "triton")

_EP_VALUE = re.compile(r"^[A-Za-z_][\w.]*(:[A-Za-z_][\w.]*)?$")  # 'package.module' or 'module:attr'


def _strict() -> bool:
    return os.environ.get("VTCORE_STRICT_PLUGINS", "") not in ("", "0")


def _allow_list() -> set[str] | None:
    raw = os.environ.get("VTCORE_PLUGINS")
    if raw is None:
        return None
    return {n.strip() for n in raw.split(",") if n.strip()}


def _format_error(exc: BaseException) -> str:
    """One line (pluggy's signature errors span several), at most 500 characters."""
    text = " ".join(f"{type(exc).__name__}: {exc}".split())
    return text if len(text) <= 500 else text[:497] + "..."


def _raised_at(exc: BaseException) -> str:
    """Where a plugin's load failure was raised: the innermost frame outside the standard library (the import
    machinery), pluggy and vtcore, which is the plugin's own line or the line of its that called a library or
    vtcore (a ``ModelFamily`` it built wrongly); "" for the manager's own verdicts (their message says what is
    wrong)."""
    if isinstance(exc, PluginError):
        if exc.__cause__ is None:
            return ""
        exc = exc.__cause__  # (a registration hook's exception, named after the hook)
    skip = (sysconfig.get_paths()["stdlib"], os.path.dirname(pluggy.__file__),
            os.path.dirname(os.path.dirname(__file__)) + os.sep, "<")  # (vtcore's own checks; generated code)
    return raised_at(exc, lambda file: not file.startswith(skip))


def _call(impl: pluggy.HookImpl) -> Any:
    """A registration hook's result; what it raises is named after the hook."""
    try:
        return impl.function()
    except Exception as exc:
        raise PluginError(f"{impl.function.__name__} raised {type(exc).__name__}: {exc}") from exc


def _installed(dist: str) -> bool:
    try:
        md.distribution(dist)
    except md.PackageNotFoundError:
        return False
    return True


def _own_version() -> str | None:
    """vtcore's installed version (the built-in plugin's), None when run from a tree never installed."""
    try:
        return md.version("vtcore")
    except md.PackageNotFoundError:
        return None


class Plugins:
    """The plugin manager and the registries (families, quant methods, loaders) it fills."""

    def __init__(self, entry_points: Iterable[md.EntryPoint] | None = None) -> None:
        self.pm = pluggy.PluginManager("vtcore")
        self.pm.add_hookspecs(hookspecs)
        self.infos: dict[str, PluginInfo] = {}
        self.families: dict[str, ModelFamily] = {}  # family name -> family
        self.architectures: dict[str, ModelFamily] = {}  # HF architecture -> family
        self.conflicts: dict[str, list[str]] = {}  # architecture -> plugins that both registered it
        self.quant_methods: dict[str, tuple[str, str]] = {}  # format -> (plugin, ref)
        self.loaders: dict[str, tuple[str, str]] = {}  # load_format -> (plugin, ref)
        self._register(BUILTIN_NAME, lambda: importlib.import_module("vtcore.plugins.builtin"), dist="vtcore",
                       version=_own_version())
        if entry_points is None:
            entry_points = md.entry_points(group=ENTRY_POINT_GROUP)
        allow = _allow_list()
        entry_points = sorted(entry_points, key=lambda e: e.name)
        #: (name, value) of each entry point given: what another process needs to load the same plugins
        self.entry_points = [(ep.name, ep.value) for ep in entry_points]
        for ep in entry_points:
            if allow is not None and ep.name not in allow:
                continue
            dist = getattr(ep, "dist", None)
            self._register(ep.name, ep.load, ep.value, dist.metadata["Name"] if dist else None,
                           dist.version if dist else None)
        #: installed plugins that VTCORE_PLUGINS leaves out
        self.excluded = sorted(ep.name for ep in entry_points if allow is not None and ep.name not in allow)
        for name in sorted((allow or set()) - {ep.name for ep in entry_points} - {BUILTIN_NAME}):
            self.infos[name] = PluginInfo(name=name, module=name, error=_format_error(PluginError(
                f"VTCORE_PLUGINS names {name!r}, which no installed package provides (installed: "
                f"{sorted({ep.name for ep in entry_points})})")))
            log.warning("vtcore: %s", self.infos[name].error)

    # ------------------------------------------------------------------ loading
    def _register(self, name: str, load: Callable[[], Any], value: str | None = None,
                  dist: str | None = None, version: str | None = None) -> None:
        if name in self.infos:  # two distributions, one entry-point name: the first keeps it
            first = self.infos[name]
            name = f"{name} [{dist or value}]"
            error = PluginError(f"entry point name {first.name!r} is used by both {first.dist or first.module!r} and "
                                f"{dist or value!r}; only the first is loaded (uninstall one)")
            self.infos[name] = PluginInfo(name=name, module=value or name, dist=dist, version=version,
                                          error=_format_error(error))
            log.warning("vtcore: plugin %r failed to load: %s", name, self.infos[name].error)
            if _strict():
                raise error
            return
        info = PluginInfo(name=name, module=value or name, dist=dist, version=version)
        self.infos[name] = info
        registered = False
        try:
            if value is not None and not _EP_VALUE.match(value):
                raise PluginError(f"entry point value {value!r}: expected an importable module path such as "
                                  "'my_plugin.plugin'")
            before = [m for m in HEAVY_MODULES if m in sys.modules]
            module = load()
            info.heavy_imports = [m for m in HEAVY_MODULES if m in sys.modules and m not in before]
            if not isinstance(module, types.ModuleType):
                raise PluginError(f"entry point {value!r} is {type(module).__name__}, expected a module")
            self.pm.register(module, name=name)
            registered = True
            self.pm.check_pending()
            info.hooks = sorted(
                h.name for h in self.pm.get_hookcallers(module) or [])
            self._collect(name, module)
        except (Exception, SystemExit) as exc:  # noqa: BLE001 - a broken plugin must not take the others down
            if registered:
                self.pm.unregister(name=name)
            info.hooks = []  # nothing of it is registered
            info.error = _format_error(exc) + _raised_at(exc)
            log.warning("vtcore: plugin %r failed to load: %s", name, info.error)
            if _strict():
                raise PluginError(f"plugin {name!r} failed to load: {info.error}") from exc

    def _impls(self, hook: str, module: Any) -> list[pluggy.HookImpl]:
        return [i for i in getattr(self.pm.hook, hook).get_hookimpls() if i.plugin is module]

    def _collect(self, name: str, module: Any) -> None:
        """Call the plugin's registration hooks and commit what they return, all or nothing."""
        families: list[ModelFamily] = []
        for impl in self._impls("vtcore_model_families", module):
            result = _call(impl)
            if not isinstance(result, (list, tuple)) or not all(isinstance(f, ModelFamily) for f in result):
                raise PluginError(f"vtcore_model_families returned {result!r}, expected a list of ModelFamily")
            families += [attrs.evolve(f, plugin=name) for f in result]
        tables: dict[str, dict[str, str]] = {"vtcore_quant_methods": {}, "vtcore_loaders": {}}
        for hook, table in tables.items():
            for impl in self._impls(hook, module):
                result = _call(impl)
                if not isinstance(result, dict) or not all(
                        isinstance(k, str) and isinstance(v, str) and ":" in v for k, v in result.items()):
                    raise PluginError(f"{hook} returned {result!r}, expected a dict of name -> 'module:attr'")
                table.update(result)
        for kind, keys in (("model family name", [f.name for f in families]),
                           ("architecture", [a for f in families for a in f.architectures])):
            twice = sorted({k for k in keys if keys.count(k) > 1})
            if twice:
                raise PluginError(f"{kind} {twice[0]!r} is registered twice by {name!r} itself")
        for family in families:
            if family.name in self.families:
                raise PluginError(f"model family name {family.name!r} is registered by both "
                                  f"{self.families[family.name].plugin!r} and {name!r}")
        for hook, registered in (("vtcore_quant_methods", self.quant_methods), ("vtcore_loaders", self.loaders)):
            taken = sorted(set(tables[hook]) & set(registered))
            if taken:
                kind = "quant format" if hook == "vtcore_quant_methods" else "load format"
                raise PluginError(f"{kind} {taken[0]!r} is registered by both {registered[taken[0]][0]!r} and "
                                  f"{name!r}; a plugin may not replace another's (uninstall one or narrow "
                                  "VTCORE_PLUGINS)")
        clashes = [a for f in families for a in f.architectures if a in self.architectures or a in self.conflicts]
        if clashes:
            # Nothing of this plugin is committed; the contested architectures resolve to neither.
            for arch in clashes:
                first = self.architectures.pop(arch).plugin if arch in self.architectures else self.conflicts[arch][0]
                self.conflicts.setdefault(arch, [first]).append(name)
            arch = clashes[0]
            raise PluginError(f"architecture {arch!r} is registered by both {self.conflicts[arch][0]!r} "
                              f"and {name!r}; it resolves to neither until one is uninstalled "
                              "(or excluded with VTCORE_PLUGINS)")
        for family in families:
            self.families[family.name] = family
            for arch in family.architectures:
                self.architectures[arch] = family
        for fmt, ref in tables["vtcore_quant_methods"].items():
            self.quant_methods[fmt] = (name, ref)
        for fmt, ref in tables["vtcore_loaders"].items():
            self.loaders[fmt] = (name, ref)

    # ------------------------------------------------------------------ lookups
    def family_for(self, architecture: str) -> ModelFamily:
        """The family serving an HF architecture name, or an error naming it and what to install."""
        if architecture in self.conflicts:
            a, b = self.conflicts[architecture][:2]
            raise PluginError(f"architecture {architecture!r} is registered by both {a!r} and {b!r}; "
                              "uninstall one or narrow VTCORE_PLUGINS")
        if architecture in self.architectures:
            return self.architectures[architecture]
        by_plugin: dict[str, list[str]] = {}
        for arch, fam in sorted(self.architectures.items()):
            by_plugin.setdefault(fam.plugin, []).append(arch)
        supported = "; ".join(f"{p}: {', '.join(a)}" for p, a in by_plugin.items()) or "none (no model plugin loaded)"
        pkg = next((pkg for pkg, archs in FIRST_PARTY_PACKAGES.items() if architecture in archs), None)
        hint = ("install a vtcore plugin that registers it (docs/writing-a-plugin.md shows how to write one)"
                if pkg is None else f"pip install {pkg}" if not _installed(pkg)
                else f"{pkg} is installed: let VTCORE_PLUGINS load its plugin" if self.excluded
                else f"{pkg} is installed, but its plugin did not load (above)"
                if any(i.dist == pkg and i.error for i in self.infos.values())
                else f"reinstall {pkg} (it is installed, but no plugin of it was loaded)")
        # (an installed plugin that did not load, or that VTCORE_PLUGINS leaves out, may be the one that serves it)
        failed = "; ".join(f"{n} ({e})" for n, e in self.errors.items())
        raise UnknownArchitectureError(
            f"architecture {architecture!r} is not supported. Supported, by plugin: {supported}. "
            + (f"Plugins that did not load: {failed}. " if failed else "")
            + (f"VTCORE_PLUGINS leaves out the installed plugins {self.excluded}. " if self.excluded else "")
            + f"To serve it: {hint}.")

    def family(self, name: str) -> ModelFamily:
        """A family by its registered name."""
        if name not in self.families:
            failed = "; ".join(f"{n} ({e})" for n, e in self.errors.items())
            raise UnknownArchitectureError(
                f"model family {name!r} is not registered; registered: {sorted(self.families) or 'none'}"
                + (f"; plugins that did not load: {failed}" if failed else ""))
        return self.families[name]

    def loader(self, load_format: str) -> Callable[..., None]:
        """The loader function registered for ``load_format``."""
        if load_format not in self.loaders:
            raise ValueError(f"load_format={load_format!r}: expected one of {sorted(self.loaders)}")
        return resolve_ref(self.loaders[load_format][1])

    def quant_method(self, fmt: str) -> type:
        """The QuantMethod class registered for a compressed-tensors format name."""
        if fmt not in self.quant_methods:
            known = ", ".join(f"{f} ({p})" for f, (p, _) in sorted(self.quant_methods.items())) or "none"
            raise ValueError(f"quantization format {fmt!r} is not supported; registered: {known}. "
                             "Install the quant plugin that provides it (vtcore-quant-nvfp4, vtcore-quant-mxfp4).")
        return resolve_ref(self.quant_methods[fmt][1])

    @property
    def errors(self) -> dict[str, str]:
        """Plugin name -> load error, for every plugin that failed."""
        return {n: i.error for n, i in self.infos.items() if i.error}


_PLUGINS: Plugins | None = None


def get_plugins() -> Plugins:
    """The process-wide plugin manager, loaded on first use."""
    global _PLUGINS
    if _PLUGINS is None:
        _PLUGINS = Plugins()
    return _PLUGINS


def plugins_from(entry_points: list[tuple[str, str]]) -> Plugins:
    """A manager of the plugins of ``entry_points`` ((name, value) pairs: ``Plugins.entry_points`` of another
    process's manager)."""
    return Plugins(md.EntryPoint(name, value, ENTRY_POINT_GROUP) for name, value in entry_points)


def reset_plugins(plugins: Plugins | None = None) -> None:
    """Drop (or replace) the process-wide plugin manager; the next lookup reloads entry points."""
    global _PLUGINS
    _PLUGINS = plugins


@contextmanager
def use_plugins(plugins: Plugins) -> Iterator[Plugins]:
    """Make ``plugins`` the process-wide manager for the duration of the block."""
    global _PLUGINS
    previous, _PLUGINS = _PLUGINS, plugins
    try:
        yield plugins
    finally:
        _PLUGINS = previous
