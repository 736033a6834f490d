"""What a front end (the HTTP server, a command line) needs of an engine besides ``generate``.

``LLM`` and ``AsyncLLM`` both offer it through ``EngineFrontEnd``: tokenizing prompts and chats the
way ``generate`` will, the engine's fixed limits (to refuse a request before it is queued), the
checkpoint's default sampling values and the live counts a metrics endpoint exports. A front end
that uses only these never depends on the scheduler, the block pool or the runner.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

from vtcore.engine.capacity import EngineLimits, EngineStats
from vtcore.errors import NotSupportedError
from vtcore.sampling_params import SamplingParams

if TYPE_CHECKING:
    from vtcore.engine.llm_engine import LLMEngine, Prompt


def refuse_lora(lora_request: Any) -> None:
    """vLLM's ``lora_request`` argument, which must be None here (no adapters)."""
    if lora_request is not None:
        raise NotSupportedError(f"lora_request={lora_request!r}: LoRA adapters are not supported; expected None")


class EngineFrontEnd:
    """The front-end half of ``LLM`` and ``AsyncLLM``, over their ``engine`` (an ``LLMEngine``).

    Tokenizing may run on any thread while the engine steps: it reads only the tokenizer.
    """

    engine: LLMEngine

    @property
    def model(self) -> str:
        """The model served, as given: a checkpoint folder or a Hugging Face hub id."""
        return self.engine.config.model

    @property
    def profiling(self) -> bool:
        """Whether ``start_profile`` can record: the engine was given a ``profiler_config``."""
        return self.engine.config.profiler_config is not None

    @property
    def tokenizer(self) -> Any:
        """The checkpoint's Hugging Face tokenizer, or None when it has none."""
        return self.engine.tokenizer

    def tool_parser(self) -> Any:
        """The served family's tool-call parser (the ``vtcore_tool_parser`` hook), or None."""
        from vtcore.plugins.manager import get_plugins

        return get_plugins().pm.hook.vtcore_tool_parser(family=self.engine.family)

    def tokenize(self, prompt: Prompt, add_special_tokens: bool = True) -> tuple[str | None, list[int]]:
        """(text, token ids) of a prompt exactly as ``generate`` would take it (text with the tokenizer's
        special tokens unless ``add_special_tokens`` is False); a ``ValueError`` names what is wrong (ids
        outside the vocabulary, no tokenizer)."""
        return self.engine.tokenize(prompt, add_special_tokens)

    def detokenize(self, token_ids: list[int]) -> str:
        """The text of ``token_ids``, special tokens included; a ``ValueError`` names ids outside the
        vocabulary, or says the checkpoint has no tokenizer."""
        return self.engine.detokenize(token_ids)

    def chat_prompt(self, messages: list[dict[str, Any]], **template_kwargs: Any) -> dict[str, Any]:
        """``{"prompt": text, "prompt_token_ids": ids}`` of a conversation through the chat template
        (``vtcore.engine.prompt_text.PromptText.chat_prompt``: the template, its switches and variables)."""
        return self.engine.chat_prompt(messages, **template_kwargs)

    def limits(self) -> EngineLimits:
        """The fixed limits a request must fit: context, vocabulary, KV pool, batch."""
        return self.engine.limits()

    def default_sampling(self) -> dict[str, Any]:
        """The ``SamplingParams`` fields the checkpoint's generation_config.json sets (vLLM's
        ``generation_config="auto"``), or none with ``generation_config="vllm"``, then
        ``override_generation_config``'s over them."""
        return self.engine.default_sampling()

    def max_tokens_cap(self) -> int | None:
        """vLLM's ``override_max_tokens``: the most tokens a served request may generate, whatever it asks for:
        ``override_generation_config``'s ``max_new_tokens``, or, with ``generation_config`` a folder, the
        ``max_tokens`` of the defaults it gives (None: no cap)."""
        config = self.engine.config
        if config.generation_config not in ("auto", "vllm"):
            return self.default_sampling().get("max_tokens")
        return (config.override_generation_config or {}).get("max_new_tokens")

    def get_default_sampling_params(self) -> SamplingParams:
        """SamplingParams with the checkpoint's generation_config.json sampling values (vLLM's
        ``generation_config="auto"``); what ``generate`` uses when given none."""
        return SamplingParams(**self.default_sampling())

    def stats(self) -> EngineStats:
        """The engine's load now (safe from any thread): running, waiting, KV usage, preemptions."""
        return self.engine.stats()
