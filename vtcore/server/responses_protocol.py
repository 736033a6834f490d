"""The request body of ``POST /v1/responses`` (OpenAI's Responses API for text, vLLM's extras beside it): what a
shape or a range can say is said here, so validation and ``/openapi.json`` agree (see
:mod:`vtcore.server.protocol`); :mod:`vtcore.server.responses` serves it."""
from __future__ import annotations

from typing import Annotated, Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, create_model, model_validator
from pydantic_core import PydanticCustomError

from vtcore.server.protocol import (ASKS_ALTERNATIVES, STREAMED_ONLY, TEMPLATE_SWITCHES, UNSUPPORTED_EXTENSIONS, Count,
                                    GenerationRequest, Int, Text, integer)


def _only(kinds: tuple[str, ...], what: str) -> Any:
    """A before-validator refusing, by its type, an object whose ``type`` is not one of ``kinds`` (a clearer word
    than the fields that kind lacks)."""
    def check(cls: type, value: Any) -> Any:
        if isinstance(value, dict) and isinstance(value.get("type"), str) and value["type"] not in kinds:
            raise PydanticCustomError("unsupported_kind", "{what} of type '{kind}': not served; expected {kinds}",
                                      {"kind": value["type"], "what": what, "kinds": " or ".join(kinds)})
        return value
    return model_validator(mode="before")(check)


class InputPart(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)

    type: Literal["input_text", "output_text"] = Field(description="Text parts only (the kind served).")
    text: Text

    _text_only = _only(("input_text", "output_text"), "a content part")


class InputMessage(BaseModel):
    """A message of the input (``type`` "message" or left out); an assistant's may be a former response's output."""

    model_config = ConfigDict(extra="allow", strict=True)

    type: Literal["message"] | None = None
    role: Literal["user", "system", "developer", "assistant"]
    content: Text | list[InputPart]


class FunctionCallItem(BaseModel):
    """A call the model made in an earlier turn (a former response's ``function_call`` item)."""

    model_config = ConfigDict(extra="allow", strict=True)

    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str


class FunctionCallOutputItem(BaseModel):
    """A call's result, for the model to go on with."""

    model_config = ConfigDict(extra="allow", strict=True)

    type: Literal["function_call_output"]
    call_id: str
    output: Text


InputItem = InputMessage | FunctionCallItem | FunctionCallOutputItem


class FunctionTool(BaseModel):
    """A function the model may call (OpenAI's Responses form: the function's fields beside ``type``)."""

    model_config = ConfigDict(extra="allow", strict=True)

    type: Literal["function"]
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None

    _functions_only = _only(("function",), "a tool")  # (hosted tools: web_search, file_search, ...)

    def as_chat_tool(self) -> dict[str, Any]:
        """The chat form, which the chat template and the tool-call parser take."""
        fields = self.model_dump(exclude={"type"}, exclude_none=True)
        return {"type": "function", "function": {k: v for k, v in fields.items() if k in
                                                 ("name", "description", "parameters", "strict")}}


class NamedFunction(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)

    type: Literal["function"]
    name: str


class TextFormat(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True, populate_by_name=True, json_schema_extra={
        "if": {"properties": {"type": {"const": "json_schema"}}, "required": ["type"]},
        "then": {"required": ["schema"], "properties": {"schema": {"type": "object"}}}})

    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None
    description: str | None = None


class TextConfig(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)

    format: TextFormat | None = None


class ResponsesRequest(GenerationRequest):
    """OpenAI's Responses request with the sampling fields and vLLM extras a chat takes; one output."""

    refused_extensions: ClassVar[dict[str, Any]] = {
        **UNSUPPORTED_EXTENSIONS, **TEMPLATE_SWITCHES, "max_completion_tokens": None, "logprobs": False,
        "previous_response_id": None, "background": False, "prompt": None,
        "reasoning": None, "truncation": "disabled", "max_tool_calls": None, "conversation": None}
    refusal_reasons: ClassVar[dict[str, str]] = {
        "previous_response_id": "no response is stored here to continue from (send the conversation as input)",
        "conversation": "no conversation is stored here (send it as input)",
        "background": "background responses are not served (nothing is stored to poll)",
        "prompt": "stored prompt templates are not served",
        "reasoning": "reasoning settings are not served",
        "truncation": "the input is never truncated here", "max_tool_calls": "a limit on calls is not served",
        "logprobs": "chat's; here include ['message.output_text.logprobs'] and top_logprobs",
        "max_completion_tokens": "chat's; here max_output_tokens"}
    output_counts: ClassVar[tuple[str, ...]] = ("max_tokens", "max_output_tokens")
    # what the endpoint refuses otherwise, the document says: a required or named tool_choice asks for tools
    # (alternatives to a token's logprob ask for its logprobs, which no offered tool may split from the answer)
    schema_rules: ClassVar[dict[str, Any]] = {"allOf": [STREAMED_ONLY, {
        "if": {"properties": {"tool_choice": {"anyOf": [{"const": "required"}, {"type": "object"}]}},
               "required": ["tool_choice"]},
        "then": {"properties": {"tools": {"type": "array", "minItems": 1}}, "required": ["tools"]}}, {
        "if": {"properties": {"top_logprobs": ASKS_ALTERNATIVES}, "required": ["top_logprobs"]},
        "then": {"properties": {"include": {"type": "array", "contains": {"const": "message.output_text.logprobs"}}},
                 "required": ["include"]}}, {
        # the answer's logprobs only where no offered tool may split the output
        "if": {"properties": {"include": {"type": "array", "contains": {"const": "message.output_text.logprobs"}}},
               "required": ["include"]},
        "then": {"anyOf": [{"not": {"required": ["tools"]}}, {"properties": {"tools": {"type": ["null", "array"],
                                                                                          "maxItems": 0}}},
                           {"properties": {"tool_choice": {"const": "none"}}, "required": ["tool_choice"]}]}}]}

    input: Text | Annotated[list[InputItem], Field(min_length=1)] = Field(
        description="Text (a user message), or messages of text parts; rendered by the chat template after the "
                    "instructions.")
    instructions: Text | None = Field(None, description="A system message before the input.")
    max_output_tokens: Count | None = None
    text: TextConfig | None = None
    n: integer(ge=1, le=1) | None = Field(1, description="One output a response.")
    response_format: None = Field(None, description="Chat's; here text.format.")
    prompt_logprobs: None = Field(None, description="Chat's and completions'; not served here.")
    return_token_ids: bool | None = Field(None, json_schema_extra={"enum": [False, None]},
                                          description="Chat's and completions'; not served here.")
    tools: list[FunctionTool] | None = Field(None, description="Functions only (hosted tools are not served).")
    tool_choice: Literal["none", "auto", "required"] | NamedFunction | None = None
    parallel_tool_calls: bool | None = None
    store: bool | None = Field(None, description="Taken; no response is kept (nothing to retrieve or continue).")
    metadata: dict[str, str] | None = Field(None, max_length=16, description="Echoed in the response.")
    include: list[Literal["message.output_text.logprobs"]] | None = Field(
        None, description="Extra output: the answer's token logprobs (the only kind served).")
    logprob_counts: ClassVar[tuple[str, ...]] = ("top_logprobs",)
    top_logprobs: Int | None = Field(None, description=(
        "With include's logprobs: alternatives a token, at most the server's --max-logprobs (vLLM's; default 20; -1 "
        "there also allows -1 here: the whole vocabulary)."))
    chat_template_kwargs: dict[str, Any] | None = Field(
        None, description="vLLM's: extra variables for the chat template (e.g. Qwen3's enable_thinking).")


def without_logprobs(model: type[ResponsesRequest]) -> type[ResponsesRequest]:
    """``model`` whose ``include`` is empty: a server with a reasoning parser does not serve the answer's
    logprobs (its tokens would not be told apart from the thought's), and its document says so."""
    return create_model(model.__name__, __base__=model, __doc__=model.__doc__, include=(
        Annotated[list[Literal["message.output_text.logprobs"]], Field(max_length=0)] | None, Field(
            None, description="Extra output: none beside this server's reasoning parser.")))
