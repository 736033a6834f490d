"""Prompts to token ids and back, and constraints to grammars, as every engine and front end takes them
(``PromptText``).

``LLMEngine`` and the front end of an engine core in another process (``vtcore.engine.core_process``)
both mix it in, so the server tokenizes a prompt exactly as the engine that runs it would, and refuses a
constraint the engine could not compile before sending it (the core compiles it again for its matchers).
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

from vtcore.errors import RequestRejected
from vtcore.sampling_params import as_int

if TYPE_CHECKING:
    from vtcore.structured.grammar import GrammarCache
    from vtcore.structured.params import StructuredOutputsParams

#: A prompt: text, ``{"prompt": text}``, or ``{"prompt_token_ids": [...]}`` (with an optional ``"prompt"``);
#: a dict may carry vLLM's ``"cache_salt"`` (:func:`prompt_cache_salt`).
Prompt = str | dict[str, Any]
#: the keys a prompt dict may have
PROMPT_KEYS = frozenset({"prompt", "prompt_token_ids", "cache_salt"})


def prompt_cache_salt(prompt: Prompt) -> str | None:
    """A prompt dict's ``"cache_salt"`` (vLLM's: only requests of the same salt share prefix-cache blocks), or
    None; anything but a non-empty string is refused."""
    salt = prompt.get("cache_salt") if isinstance(prompt, dict) else None
    if salt is not None and not _unicode(salt):
        raise ValueError(f"cache_salt={salt!r}: expected a non-empty string of valid Unicode (no lone surrogate)")
    return salt


def _unicode(text: Any) -> bool:
    """Whether ``text`` is a non-empty string UTF-8 can encode (a lone surrogate cannot be hashed)."""
    if not isinstance(text, str) or not text:
        return False
    try:
        text.encode()
    except UnicodeEncodeError:
        return False
    return True


def check_messages(messages: Any) -> None:
    """A conversation as a chat template takes it: a non-empty list (or tuple) of dicts, each with a string
    ``role`` (a template given anything else fails inside Jinja, naming neither the message nor what it lacks)."""
    if not isinstance(messages, (list, tuple)) or not messages:
        raise ValueError(f"messages={messages!r}: expected a non-empty list of messages (dicts with 'role' and "
                         "'content')")
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise ValueError(f"messages[{i}]={m!r}: expected a dict with a 'role' (a string, e.g. 'user') and "
                             "its 'content'")


#: apply_chat_template's own arguments, which a caller may not pass as template variables
TEMPLATE_ARGUMENTS = frozenset({"chat_template", "conversation", "tokenize", "add_generation_prompt",
                                "continue_final_message", "tools", "documents", "return_dict", "tokenizer_kwargs"})


class UnsupportedContent(ValueError):
    """A message content part of a type other than text."""


def message_text(i: int, role: str, content: Any, tool_calls: Any = None) -> str:
    """Message ``i``'s content as a chat template takes it (OpenAI's and vLLM's forms): a string as it is, a
    list of text parts (``{"type": "text", "text": ...}``) joined by newlines, None only for an assistant
    message of ``tool_calls`` (then ""). Anything else raises ``ValueError`` naming the message
    (``UnsupportedContent`` for a part of another type)."""
    if isinstance(content, str):
        return content
    if content is None:
        if role == "assistant" and tool_calls:
            return ""
        raise ValueError(f"messages[{i}].content: null; only an assistant message of tool_calls may have no content")
    if not isinstance(content, (list, tuple)):
        raise ValueError(f"messages[{i}].content={content!r}: expected a string, a list of text parts or null")
    parts = []
    for part in content:
        kind, text = (part.get("type"), part.get("text")) if isinstance(part, dict) else \
            (getattr(part, "type", None), getattr(part, "text", None))
        if kind != "text":
            raise UnsupportedContent(f"messages[{i}].content: part of type {kind!r}; only text parts are supported")
        if not isinstance(text, str):
            raise ValueError(f"messages[{i}].content: a text part's text={text!r}: expected a string")
        parts.append(text)
    return "\n".join(parts)


class PromptText:
    """Over ``tokenizer`` (a Hugging Face tokenizer or None), ``vocab_size``, ``eos_token_ids`` and
    ``config.model`` (named in errors)."""

    tokenizer: Any
    vocab_size: int
    eos_token_ids: list[int]
    config: Any
    _grammar_cache: GrammarCache | None = None  # built at the first constraint

    def compile_grammar(self, constraint: StructuredOutputsParams) -> None:
        """Compile ``constraint`` into the grammar cache (thread-safe: ``AsyncLLM`` calls it off the engine
        thread); a constraint xgrammar refuses raises ``ValueError`` naming the field."""
        self._grammars().compile(constraint)

    def grammar_compiled(self, constraint: StructuredOutputsParams) -> bool:
        """Whether ``constraint`` is in the grammar cache (``AsyncLLM`` then sends its request straight on)."""
        return self._grammar_cache is not None and self._grammar_cache.compiled(constraint)

    def _grammars(self) -> GrammarCache:
        """The ``GrammarCache`` for this model's tokenizer and vocabulary, built at the first constraint."""
        if self._grammar_cache is None:
            if self.tokenizer is None:
                raise RequestRejected("structured_outputs: the model has no tokenizer, and a grammar is over text")
            from vtcore.structured.grammar import GrammarCache

            self._grammar_cache = GrammarCache(self.tokenizer, self.vocab_size, self.eos_token_ids)
        return self._grammar_cache

    def tokenize(self, prompt: Prompt, add_special_tokens: bool = True) -> tuple[str | None, list[int]]:
        """(text, token ids) of a prompt (a string, ``{"prompt": str}`` or ``{"prompt_token_ids": [...]}``);
        ids are checked against the vocabulary. Text is encoded with the tokenizer's special tokens (a
        BOS where the tokenizer adds one), as vLLM and ``tokenizer(text)`` do, unless ``add_special_tokens``
        is False; ids are taken as given."""
        unknown = sorted(k for k, v in prompt.items() if v is not None and k not in PROMPT_KEYS) \
            if isinstance(prompt, dict) else []
        if unknown:
            raise ValueError(f"prompt keys {unknown}: not prompt fields this engine takes; expected "
                             f"{sorted(PROMPT_KEYS)} (text only: no multi_modal_data)")
        if isinstance(prompt, dict) and "prompt_token_ids" not in prompt and isinstance(prompt.get("prompt"), str):
            prompt = prompt["prompt"]
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError(f"text prompt given, but the checkpoint {self.config.model!r} has no tokenizer; "
                                 "pass {'prompt_token_ids': [...]} instead")
            return prompt, self.tokenizer.encode(prompt, add_special_tokens=add_special_tokens) or []
        if isinstance(prompt, dict) and "prompt_token_ids" in prompt:
            ids = prompt["prompt_token_ids"]
            if getattr(ids, "ndim", None) == 1 and hasattr(ids, "tolist"):  # a numpy array or a tensor of ids
                ids = ids.tolist()
            # (type and range checked in C loops: this runs before a long prompt's first step; integers of other
            # types, numpy's, as their ints)
            if not isinstance(ids, (list, tuple)):
                raise ValueError(f"prompt_token_ids={ids!r}: expected a list of ints")
            if not set(map(type, ids)) <= {int}:
                ids = list(map(as_int, ids))
                if not set(map(type, ids)) <= {int}:
                    raise ValueError(f"prompt_token_ids={prompt['prompt_token_ids']!r}: expected a list of ints")
            if ids and (min(ids) < 0 or max(ids) >= self.vocab_size):
                bad = [t for t in ids if not 0 <= t < self.vocab_size]
                raise RequestRejected(f"prompt_token_ids {bad[:5]}: outside the vocabulary [0, {self.vocab_size})")
            return prompt.get("prompt"), list(ids)
        raise ValueError(f"prompt={prompt!r}: expected a string or a dict with 'prompt' (a string) or "
                         "'prompt_token_ids'")

    def chat_prompt(self, messages: list[dict[str, Any]], chat_template: str | None = None,
                    add_generation_prompt: bool = True, continue_final_message: bool = False,
                    **template_kwargs: Any) -> dict[str, Any]:
        """A conversation through the chat template (``chat_template``, a Jinja template, in place of the
        tokenizer's own), with vLLM's and transformers' switches: ``add_generation_prompt`` opens the
        assistant's turn, ``continue_final_message`` leaves the final message open for the model to go on
        with (at most one of the two); ``template_kwargs`` are extra template variables (e.g. Qwen3's
        ``enable_thinking``, or ``tools``)."""
        tok = self.tokenizer
        if tok is None or not (chat_template or getattr(tok, "chat_template", None)):
            raise ValueError(f"chat: the checkpoint {self.config.model!r} has no tokenizer with a chat template; "
                             "pass chat_template")
        if add_generation_prompt and continue_final_message:
            raise ValueError("add_generation_prompt=True and continue_final_message=True: expected at most one "
                             "(open the assistant's turn, or go on with the final message)")
        check_messages(messages)
        reserved = sorted(set(template_kwargs) & (TEMPLATE_ARGUMENTS - {"tools"}))
        if reserved:
            raise ValueError(f"chat template variable {reserved[0]!r}: it is one of apply_chat_template's own "
                             "arguments; expected other variables (e.g. enable_thinking)")
        messages = [{**m, "content": message_text(i, m["role"], m.get("content"), m.get("tool_calls"))}
                    for i, m in enumerate(messages)]
        text = tok.apply_chat_template(messages, chat_template=chat_template, tokenize=False,
                                       add_generation_prompt=add_generation_prompt,
                                       continue_final_message=continue_final_message, **template_kwargs)
        return {"prompt": text, "prompt_token_ids": tok.encode(text, add_special_tokens=False)}

    def detokenize(self, token_ids: list[int]) -> str:
        """The text of ``token_ids`` (special tokens kept), the ids checked against the vocabulary."""
        if self.tokenizer is None:
            raise ValueError(f"detokenize: the checkpoint {self.config.model!r} has no tokenizer")
        bad = [t for t in token_ids if not 0 <= t < self.vocab_size]
        if bad:
            raise RequestRejected(f"token ids {bad[:5]}: outside the vocabulary [0, {self.vocab_size})")
        return self.tokenizer.decode(token_ids, skip_special_tokens=False)
