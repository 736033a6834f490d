"""vLLM's prompt types, ``TextPrompt`` and ``TokensPrompt``: typed dicts, so ``TokensPrompt(prompt_token_ids=[...])``
is the dict ``LLM.generate`` and ``AsyncLLM.generate`` take (a ported script's imports work as they are)."""
from __future__ import annotations

from typing import NotRequired, TypedDict


class TextPrompt(TypedDict):
    """A prompt as text, encoded by the model's tokenizer; ``cache_salt``: only prompts of the same salt share
    prefix-cache blocks."""

    prompt: str
    cache_salt: NotRequired[str]


class TokensPrompt(TypedDict):
    """A prompt as token ids, taken as given; ``prompt``: its text, if the caller has it (shown in the output)."""

    prompt_token_ids: list[int]
    prompt: NotRequired[str]
    cache_salt: NotRequired[str]
