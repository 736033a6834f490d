"""Request bodies of the OpenAI-compatible server (OpenAI's field names, plus vLLM's sampling extras).

Only the shapes are checked here; values are checked by ``SamplingParams`` and the server, so every
bad value is answered with a 400 that names its field. Unknown fields are ignored (as vLLM does).
"""
from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore")

    include_usage: bool | None = False


class _Sampling(BaseModel):
    """Fields that completions and chat share."""

    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    n: int | None = 1
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    seed: int | None = None
    user: str | None = None
    # vLLM's extras
    best_of: int | None = None
    use_beam_search: bool | None = False
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    min_tokens: int | None = None
    ignore_eos: bool | None = False
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool | None = False
    skip_special_tokens: bool | None = True


#: A completions prompt: text, token ids, or a batch of either (each its own choice).
PromptField = str | list[int] | list[str] | list[list[int]]


class CompletionRequest(_Sampling):
    prompt: PromptField
    max_tokens: int | None = 16  # OpenAI's default for completions
    echo: bool | None = False
    logprobs: int | None = None
    suffix: str | None = None


class ContentPart(BaseModel):
    model_config = ConfigDict(extra="allow")

    type: str
    text: str | None = None


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")

    role: str
    content: str | list[ContentPart] | None = None
    name: str | None = None


class ResponseFormat(BaseModel):
    model_config = ConfigDict(extra="allow")

    type: str


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None
    logprobs: bool | None = False
    top_logprobs: int | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    functions: list[dict[str, Any]] | None = None
    function_call: str | dict[str, Any] | None = None
    response_format: ResponseFormat | None = None
