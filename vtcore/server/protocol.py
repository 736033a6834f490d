"""Request bodies of the OpenAI-compatible server (OpenAI's field names, plus vLLM's sampling extras).

Only the shapes are checked here; values are checked by ``SamplingParams`` and the server, so every
bad value is answered with a 400 that names its field. Unknown fields are ignored (as vLLM does),
but for vLLM's own extensions that this server does not implement and that would change the output
(``UNSUPPORTED_EXTENSIONS``): answering those with unconstrained text would be silently wrong.
"""
from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore")

    include_usage: bool | None = False


#: vLLM request fields this server does not implement, each with the value that asks for nothing
#: (sent with any other value, the request is refused with a 400 naming the field)
UNSUPPORTED_EXTENSIONS: dict[str, Any] = {
    "guided_json": None, "guided_regex": None, "guided_choice": None, "guided_grammar": None,
    "structured_outputs": None, "allowed_token_ids": None, "bad_words": None, "prompt_logprobs": None,
    "truncate_prompt_tokens": None, "logits_processors": None, "return_tokens_as_token_ids": False,
    "length_penalty": 1.0, "spaces_between_special_tokens": True, "add_generation_prompt": True,
    "continue_final_message": False, "chat_template": None,
}


class ResponseFormat(BaseModel):
    model_config = ConfigDict(extra="allow")

    type: str


class _Sampling(BaseModel):
    """Fields that completions and chat share (other fields are kept in ``model_extra``)."""

    model_config = ConfigDict(extra="allow")

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
    response_format: ResponseFormat | None = None  # only type "text" is served (vLLM takes it on both routes)


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


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None
    logprobs: bool | None = False
    top_logprobs: int | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    functions: list[dict[str, Any]] | None = None
    function_call: str | dict[str, Any] | None = None
    chat_template_kwargs: dict[str, Any] | None = None  # vLLM's: extra variables for the chat template
