"""Every hook a vtcore plugin can implement (pluggy project name ``"vtcore"``).

Plugins are modules named by entry points in the group ``vtcore``; they import
``vtcore.hookimpl`` and never pluggy itself. Hooks are consulted when the plugin manager loads
(registrations) or when a model is built (EmbedInto, scope, conformance), never per engine
step: the forward calls the pieces the hooks supplied directly, so pluggy stays off the hot path.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, ContextManager

import pluggy

if TYPE_CHECKING:
    from vtcore.family import ConformanceExample, ModelFamily
    from vtcore.layers.embedding import EmbedInto

hookspec = pluggy.HookspecMarker("vtcore")
hookimpl = pluggy.HookimplMarker("vtcore")

#: A device-token scope factory: ``scope(device_ids, host_ids_stale)`` returns the context manager
#: the runner opens around one forward. See ``vtcore.layers.embedding.device_token_scope``.
ScopeFactory = Callable[[Any, bool], ContextManager[None]]


@hookspec
def vtcore_model_families() -> list[ModelFamily]:
    """Register model families.

    Called once per plugin when the plugin manager loads. Return the ``ModelFamily`` objects the
    plugin provides; each maps HF ``architectures`` names to a lazy ``"module:Class"``. Two
    plugins registering one architecture is an error naming both; the architecture then resolves
    to neither.
    """


@hookspec
def vtcore_quant_methods() -> dict[str, str]:
    """Register quantization methods.

    Called once per plugin when the plugin manager loads. Return a mapping from a
    compressed-tensors format name (``quantization_config.format``, e.g. ``"nvfp4-pack-quantized"``)
    to a lazy ``"module:Class"`` of a ``vtcore.quant.base.QuantMethod`` subclass. Consulted when a
    checkpoint with that format is loaded: the class is built from the ``quantization_config`` and
    takes over every layer whose checkpoint modules it ``quantizes`` (``vtcore.layers.quantized``).
    """


@hookspec
def vtcore_loaders() -> dict[str, str]:
    """Register weight loaders.

    Called once per plugin when the plugin manager loads. Return a mapping from a ``load_format``
    name (``"safetensors"``, ``"dummy"``, ...) to a lazy ``"module:function"`` with the signature
    ``load(model, model_path: str, hf_config, seed: int) -> None`` that fills the model's
    parameters in place. vtcore's own loaders register through this hook too.
    """


@hookspec(firstresult=True)
def vtcore_embed_into(family: ModelFamily, embed: EmbedInto) -> EmbedInto | None:
    """Supply or wrap the EmbedInto module of a freshly built model.

    Called once for every ``EmbedInto`` module of a model, right after the model class is built,
    before weights load. Return a replacement module (it must keep honouring the device-token
    override) or None to keep ``embed``. Stops at the first non-None result.
    """


@hookspec(firstresult=True)
def vtcore_device_token_scope(family: ModelFamily, scope: ScopeFactory) -> ScopeFactory | None:
    """Supply or wrap the device-token override scope the runner opens around every forward.

    Called once when the runner is built. ``scope(device_ids, host_ids_stale)`` is the core's
    factory; return a wrapping factory (for tracing, counting) or None to keep it. Stops at the
    first non-None result.
    """


@hookspec(firstresult=True)
def vtcore_mtp_head(family: ModelFamily, model: Any, hf_config: Any) -> Any:
    """Build the multi-token-prediction head of ``model``, a freshly built model of ``family``.

    Called once when a model is built with its MTP head asked for (speculative decoding by the
    family's own head), right after the model class is built, before quantization and weights.
    Return the head, a ``vtcore.layers.mtp.MultiTokenPredictor`` (or a module with its contract:
    ``forward(input_ids, positions, hidden, step)`` -> hidden states for the target's lm_head, and
    ``attach(model)``), or None when the family, or this checkpoint's config, has none; the core
    attaches it as ``model.mtp``, so its tensors load from the checkpoint's ``mtp.*`` and its
    attention layers get KV caches. Stops at the first non-None result.
    """


@hookspec(firstresult=True)
def vtcore_tool_parser(family: ModelFamily) -> Any:
    """Supply the tool-call format of ``family``'s models, for the server's ``tools``.

    Called when the server parses a chat completion that offered tools. Return a class with the
    ``vtcore.server.tool_calls.ToolParser`` contract (the block tags, ``parse_block``, and
    ``block_grammar`` for tool_choice "required" or a named function; ``HermesToolParser`` is
    Qwen's format), or None. A family no plugin answers for serves no tools: a request offering
    them is refused with a 400. Stops at the first non-None result.
    """


@hookspec(firstresult=True)
def vtcore_conformance_example(family: ModelFamily) -> ConformanceExample | None:
    """Provide the conformance example of ``family``: a tiny HF config and its oracle class.

    Called by the conformance gate for every registered family. vtcore's built-in
    implementation (tried last) resolves ``family.conformance_example``; a plugin may supply an
    example for a family that another plugin registered. Stops at the first non-None result.
    """
