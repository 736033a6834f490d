"""Request and response bodies of the server (OpenAI's field names, plus vLLM's sampling extras and its
``/tokenize`` and ``/detokenize``).

What a field's shape and range can say is said here, so validation and ``/openapi.json`` agree:
every such value is answered with a 400 naming its field. Bodies are strict: a field takes JSON's type
as the document gives it, in JSON Schema's terms ("1" is no integer, false no 0 and 0 no false; 1.0 is
the integer 1). Values that depend on each other or on the model are checked by ``SamplingParams`` and
the endpoints. Unknown fields are ignored, with a warning in the log (as vLLM does), but for vLLM's own
extensions that this server does not implement and that would change the output (``UNSUPPORTED_EXTENSIONS``,
in the document at the one value each takes): answering those with unconstrained text would be silently
wrong. ``bounded`` fits a model's token-id and output-count fields to one engine's vocabulary and
context.
"""
from __future__ import annotations

from decimal import Decimal
from typing import Annotated, Any, ClassVar, TypeVar

from pydantic import (AfterValidator, BaseModel, BeforeValidator, ConfigDict, Field, ValidationError,
                      ValidatorFunctionWrapHandler, WithJsonSchema, WrapValidator, create_model)
from pydantic_core import PydanticCustomError

from vtcore.engine.capacity import EngineLimits
from vtcore.sampling_params import ASCII_SPACE

#: The most choices a prompt may ask for (OpenAI's limit for ``n``).
MAX_N = 128

#: vLLM request fields this server does not implement, each with the value that asks for nothing
#: (sent with any other value, the request is refused with a 400 naming the field)
UNSUPPORTED_EXTENSIONS: dict[str, Any] = {
    "guided_json": None, "guided_regex": None, "guided_choice": None, "guided_grammar": None,
    "logits_processors": None,
    "length_penalty": 1.0, "spaces_between_special_tokens": True, "chat_template": None,
}
#: the chat template's switches: real fields of a chat request, refused elsewhere as extensions
TEMPLATE_SWITCHES: dict[str, Any] = {"add_generation_prompt": True, "continue_final_message": False}
#: what the switches' fields refuse together, in JSON Schema: continuing the final message opens no new turn
_ONE_SWITCH = {"if": {"properties": {"continue_final_message": {"const": True}},
                      "required": ["continue_final_message"]},
               "then": {"properties": {"add_generation_prompt": {"const": False}},
                        "required": ["add_generation_prompt"]}}

#: stream_options apply to a streamed response only (OpenAI's and vLLM's rule): without stream=true, none
STREAMED_ONLY = {"if": {"not": {"properties": {"stream": {"const": True}}, "required": ["stream"]}},
                 "then": {"properties": {"stream_options": {"type": "null"}}}}


#: pydantic's "string_unicode" error, as the server words it: JSON's "\ud800" decodes to such a string
NOT_UNICODE = "not valid Unicode text: it holds a lone surrogate, which has no UTF-8 form"


def _encodable(text: str) -> str:
    """Text a tokenizer can take: a lone surrogate (JSON's ``"\\ud800"``) has no UTF-8 form. (pydantic
    refuses one itself in a constrained string, with the same error type.)"""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise PydanticCustomError("string_unicode", NOT_UNICODE) from None
    return text


class LiteralFloat(float):
    """A JSON number past 2**53 whose float is not the literal's value (``vtcore.server.json_body``): the float,
    with the ``literal`` as written."""

    literal: Decimal

    def __new__(cls, value: float, literal: Decimal) -> "LiteralFloat":
        number = super().__new__(cls, value)
        number.literal = literal
        return number

    def __reduce__(self) -> tuple:
        """Pickled with its literal (a request's schema holding one crosses to the engine core process)."""
        return LiteralFloat, (float(self), self.literal)


#: the most digits a literal's integer may have here (past it, Python's int() of a string refuses to work)
_MAX_DIGITS = 4000


def _integral(value: Any) -> Any:
    """JSON Schema's integer: a number without a fraction, 5.0 as well as 5 (pydantic's strict int takes
    only the second), of any size: a float past 2**53 is one integer, and a literal its float rounds counts as
    written (a ``LiteralFloat``: the literal's integer, or refused where the literal has a fraction)."""
    if type(value) is float and value.is_integer():
        return int(value)
    if isinstance(value, LiteralFloat) and value.literal.adjusted() < _MAX_DIGITS and \
            value.literal == value.literal.to_integral_value():
        return int(value.literal)
    return value


def integer(**bounds: int) -> Any:
    """An integer field's type with ``bounds`` (see ``_integral``); the bounds go inside the validator, where
    the document can state them (outside it, pydantic writes its own names for them)."""
    return Annotated[int, Field(**bounds), BeforeValidator(_integral)]


Int = integer()
Count = integer(ge=0)
Choices = integer(ge=1, le=MAX_N)
TopK = integer(ge=-1)
Seed = integer(ge=-2 ** 63, lt=2 ** 63)  # a 64-bit signed integer, OpenAI's and vLLM's range


def _kept_tokens(max_model_len: int | None) -> Any:
    """vLLM's ``truncate_prompt_tokens``: keep the prompt's last k tokens (k at most ``max_model_len``, where an
    engine's is known), or (-1) the last max_model_len."""
    most = f" and at most max_model_len={max_model_len}" if max_model_len else ""

    def check(value: Any) -> Any:
        if value != -1 and (value < 1 or (max_model_len and value > max_model_len)):
            raise PydanticCustomError("truncate_prompt_tokens", f"Input should be -1 or an integer >= 1{most}")
        return value

    kept = {"type": "integer", "minimum": 1, **({"maximum": max_model_len} if max_model_len else {})}
    return Annotated[int, BeforeValidator(_integral), AfterValidator(check),
                     WithJsonSchema({"anyOf": [{"const": -1}, kept]})]


#: Text that goes to the tokenizer (a prompt, a message).
Text = Annotated[str, AfterValidator(_encodable)]
NonEmptyText = Annotated[Text, Field(min_length=1)]
#: A stop string (an empty one would end every output before it began: ``SamplingParams`` refuses it).
StopString = Annotated[str, Field(min_length=1)]
#: a bad word: more than ASCII white space (``SamplingParams.bad_words``; \xNN escapes read alike in pydantic's
#: patterns and JSON Schema's)
BadWord = Annotated[str, Field(pattern="[^" + "".join(f"\\x{ord(c):02x}" for c in ASCII_SPACE) + "]")]


def _first_come(value: int) -> int:
    if value != 0:
        raise PydanticCustomError("priority", "a priority other than 0 needs vtcore serve --scheduling-policy "
                                              "priority; this server schedules first come, first served")
    return value


#: vLLM's priority where the engine schedules first come, first served: 0 only (as vLLM refuses others)
FirstComePriority = Annotated[int, BeforeValidator(_integral), AfterValidator(_first_come),
                              WithJsonSchema({"const": 0})]


def _integral_items(value: Any, handler: ValidatorFunctionWrapHandler) -> Any:
    """A list of ints (a prompt of ids, as a body usually has it) checked by pydantic alone, and if that fails,
    again with ``_integral`` of each item: a Python validator on each id cost more than the rest of a request's
    validation."""
    try:
        return handler(value)
    except ValidationError:
        if type(value) is not list:
            raise
        return handler([_integral(v) for v in value])


def _token_ids(limits: EngineLimits | None, min_length: int) -> Any:
    token = Annotated[int, Field(ge=0, **({} if limits is None else {"lt": limits.vocab_size}))]
    return Annotated[list[token], Field(min_length=min_length), WrapValidator(_integral_items)]


def _allowed(limits: EngineLimits | None) -> Any:
    where = "" if limits is None else f" (ids in [0, {limits.vocab_size}))"
    return Field(None, description=f"vLLM's: the only token ids that may be sampled{where}.")


def _prompt(limits: EngineLimits | None) -> Any:
    """A completions prompt: text, token ids, or a batch of either (each its own choice). How many
    tokens fit is the endpoint's check, which names both lengths."""
    ids = _token_ids(limits, 1)
    return (NonEmptyText | ids | Annotated[list[NonEmptyText], Field(min_length=1)]
            | Annotated[list[ids], Field(min_length=1)])


def _prompt_description(limits: EngineLimits | None) -> str:
    where = "" if limits is None else (f" Token ids are in [0, {limits.vocab_size}); a prompt has fewer than "
                                       f"{limits.max_model_len} tokens, and its tokens plus max_tokens are at "
                                       f"most {limits.max_model_len}.")
    return "Text, token ids, or a batch of either (each prompt its own choices)." + where


def below_pattern(n: int | None) -> str:
    """A regular expression of the decimal strings (ASCII digits, any leading zeros) of the integers in
    ``[0, n)`` (any size: None): a JSON object's keys that are token ids (``logit_bias``). Past its leading
    zeros, shorter than ``n - 1`` is below it; as long, below it from its first smaller digit on, or equal."""
    if n is None:
        return "^[0-9]+$"
    top = str(n - 1)
    k = len(top)
    alternatives = [f"[0-9]{{1,{k - 1}}}"] if k > 1 else []
    for i, digit in enumerate(top):
        if digit != "0":
            alternatives.append(top[:i] + f"[0-{int(digit) - 1}]" + (f"[0-9]{{{k - i - 1}}}" if i < k - 1 else ""))
    return "^0*(" + "|".join([*alternatives, top]) + ")$"


def _logit_bias(limits: EngineLimits | None) -> Any:
    """The ``logit_bias`` field: token id keys (documented by pattern, checked by the endpoint, which names the
    bad key or id) to finite biases."""
    where = "" if limits is None else f" in [0, {limits.vocab_size})"
    return Field(None, description=f"Token id (a string of an integer{where}) -> a finite bias, clamped to "
                                   "[-100, 100].",
                 json_schema_extra={"propertyNames": {"pattern": below_pattern(limits and limits.vocab_size)}})


LogitBias = dict[str, Annotated[float, Field(allow_inf_nan=False)]]
#: The unbounded forms, as the models declare them; ``bounded`` swaps in an engine's
PromptField = _prompt(None)
TokenIds = _token_ids(None, 0)
ModelT = TypeVar("ModelT", bound="BoundedModel")


class BoundedModel(BaseModel):
    """A request model with fields whose bounds are one engine's (see ``bounded``)."""

    @classmethod
    def engine_fields(cls, limits: EngineLimits) -> dict[str, Any]:
        """``{name: (annotation, FieldInfo)}`` of the fields whose bounds are ``limits``'."""
        return {}


#: a ``top_logprobs`` that asks for alternatives (vLLM's rule: -1 or above 0), in JSON Schema
ASKS_ALTERNATIVES = {"type": "integer", "not": {"const": 0}}


def _logprob_count(limits: EngineLimits, whole_vocabulary: bool = True) -> Any:
    """A count of alternatives a position (``prompt_logprobs``, chat's ``top_logprobs``, completions' ``logprobs``),
    as vLLM bounds it: at most the engine's ``max_logprobs`` and the vocabulary; -1 (the whole vocabulary) where the
    cap holds it and ``whole_vocabulary`` (vLLM's completions ``logprobs`` takes no -1)."""
    cap = limits.vocab_size if limits.max_logprobs == -1 else min(limits.max_logprobs, limits.vocab_size)
    return integer(ge=-1 if whole_vocabulary and limits.vocab_size <= cap else 0, le=cap)


def bounded(model: type[ModelT], limits: EngineLimits) -> type[ModelT]:
    """``model`` with its token-id fields bounded by ``limits`` (ids below the vocabulary size, and
    the context named in the prompt's description), so that validation and the OpenAPI document agree."""
    return create_model(model.__name__, __base__=model, __doc__=model.__doc__, **model.engine_fields(limits))


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)

    include_usage: bool | None = False
    continuous_usage_stats: bool | None = Field(
        False, description="vLLM's: with include_usage, every chunk carries its choice's usage so far.")


class ResponseFormat(BaseModel):
    # a json_schema format carries its schema (the endpoints refuse one without; the document says so)
    model_config = ConfigDict(extra="allow", strict=True, json_schema_extra={
        "if": {"properties": {"type": {"const": "json_schema"}}, "required": ["type"]},
        "then": {"required": ["json_schema"], "properties": {"json_schema": {
            "type": "object", "required": ["schema"], "properties": {"schema": {"type": "object"}}}}}})

    type: str = Field(json_schema_extra={"enum": ["text", "json_object", "json_schema"]})


def json_equal(a: Any, b: Any) -> bool:
    """Equality as JSON Schema's ``const`` has it: 1 is 1.0, but 0 is not false."""
    if isinstance(a, bool) or isinstance(b, bool):
        return type(a) is type(b) and a == b
    return a == b


def _generation_schema(schema: dict[str, Any], model: type[GenerationRequest]) -> None:
    """A generation request's document: the vLLM extensions it refuses, each taking only the value that asks
    for nothing (or null), and the model's ``schema_rules``."""
    schema["properties"].update({
        name: {"enum": [None] if value is None else [value, None], "description": "vLLM's; not served."}
        for name, value in model.refused_extensions.items()})
    schema.update(model.schema_rules)


class GenerationRequest(BoundedModel):
    """Fields that completions and chat share (other fields are kept in ``model_extra``)."""

    model_config = ConfigDict(extra="allow", strict=True, json_schema_extra=_generation_schema)
    #: vLLM extensions refused unless sent at the value that asks for nothing (``json_equal``)
    refused_extensions: ClassVar[dict[str, Any]] = {**UNSUPPORTED_EXTENSIONS, **TEMPLATE_SWITCHES}
    #: why a refused field is refused, where it is not a vLLM extension this server lacks
    refusal_reasons: ClassVar[dict[str, str]] = {}
    #: vLLM extensions the endpoints read from ``model_extra`` (not declared fields: no "ignored" warning)
    read_extensions: ClassVar[tuple[str, ...]] = ("structured_outputs",)
    #: JSON Schema keywords for what the endpoint refuses across fields
    schema_rules: ClassVar[dict[str, Any]] = {"allOf": [STREAMED_ONLY]}
    #: the fields that count output tokens: each leaves room for a prompt token within the context
    output_counts: ClassVar[tuple[str, ...]] = ("max_tokens",)
    #: the fields that count a position's alternatives: bounded by the engine's ``max_logprobs``
    logprob_counts: ClassVar[tuple[str, ...]] = ("prompt_logprobs",)

    @classmethod
    def engine_fields(cls, limits: EngineLimits) -> dict[str, Any]:
        below = integer(ge=0, lt=limits.max_model_len)
        return {**{name: (below | None, Field(cls.model_fields[name].default)) for name in cls.output_counts},
                "logit_bias": (LogitBias | None, _logit_bias(limits)),
                "allowed_token_ids": (_token_ids(limits, 1) | None, _allowed(limits)),
                "stop_token_ids": (_token_ids(limits, 0) | None, Field(
                    None, description=f"vLLM's: token ids that end the output (ids in [0, {limits.vocab_size}))")),
                "priority": (Seed if limits.by_priority else FirstComePriority,
                             Field(0, description=cls.model_fields["priority"].description)),
                "truncate_prompt_tokens": (_kept_tokens(limits.max_model_len) | None, Field(
                    None, description=cls.model_fields["truncate_prompt_tokens"].description)),
                **{name: (_logprob_count(limits, name != "logprobs") | None,
                          Field(None, description=cls.model_fields[name].description))
                   for name in cls.logprob_counts}}

    model: str | None = None
    max_tokens: Count | None = None
    temperature: float | None = Field(None, ge=0, allow_inf_nan=False)
    top_p: float | None = Field(None, gt=0, le=1)
    n: Choices | None = Field(1, description=f"Choices per prompt, at most {MAX_N} (OpenAI's limit).")
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    stop: StopString | list[StopString] | None = None
    presence_penalty: float | None = Field(None, ge=-2, le=2)
    frequency_penalty: float | None = Field(None, ge=-2, le=2)
    logit_bias: LogitBias | None = _logit_bias(None)
    seed: Seed | None = None
    user: str | None = None
    # vLLM's extras
    best_of: Int | None = Field(None, json_schema_extra={"enum": [1, None]}, description="Only 1 is served.")
    use_beam_search: bool | None = Field(False, json_schema_extra={"enum": [False, None]},
                                         description="Beam search is not served.")
    top_k: TopK | None = Field(None, description="vLLM's: at least 1, or 0 / -1 for no top-k.")
    min_p: float | None = Field(None, ge=0, le=1)
    repetition_penalty: float | None = Field(None, gt=0, allow_inf_nan=False)
    min_tokens: Count | None = None
    ignore_eos: bool | None = False
    stop_token_ids: list[Count] | None = None
    allowed_token_ids: _token_ids(None, 1) | None = _allowed(None)
    bad_words: list[BadWord] | None = Field(
        None, description="vLLM's: words never generated (a word's last token is banned where the output so far "
                          "ends in the rest of it; each word also as it follows a space).")
    truncate_prompt_tokens: _kept_tokens(None) | None = Field(
        None, description="vLLM's: keep only the prompt's last k tokens (-1: the last max_model_len).")
    include_stop_str_in_output: bool | None = False
    prompt_logprobs: Int | None = Field(
        None, description="vLLM's: each prompt position's logprob, rank and decoded token, with this many "
                          "alternatives (the first position has none: null), at most the server's --max-logprobs "
                          "(vLLM's; default 20; -1 there also allows -1 here: the whole vocabulary); completions: in "
                          "each choice, chat: in the response (not streamed).")
    skip_special_tokens: bool | None = True
    return_tokens_as_token_ids: bool | None = Field(
        None, description="vLLM's: logprobs name each token 'token_id:{id}' instead of its text (null: the server's "
                          "--return-tokens-as-token-ids).")
    priority: Seed = Field(0, description="vLLM's: under `vtcore serve --scheduling-policy priority`, lower values "
                                          "are scheduled first; otherwise only 0.")
    cache_salt: NonEmptyText | None = Field(
        None, description="vLLM's: only requests with the same salt share prefix-cache blocks (a secret per user "
                          "keeps others from timing which prompts are cached).")
    return_token_ids: bool | None = Field(
        None, description="vLLM's: the prompt's token ids (`prompt_token_ids`) and the generated ones (`token_ids`) "
                          "beside the text; streamed, the prompt's come in the first chunk and each chunk has its own.")
    response_format: ResponseFormat | None = None  # text, json_object, json_schema (vLLM takes it on both routes)


class CompletionRequest(GenerationRequest):
    prompt: PromptField = Field(description=_prompt_description(None))
    max_tokens: Count | None = 16  # OpenAI's default for completions
    echo: bool | None = False
    logprob_counts: ClassVar[tuple[str, ...]] = ("prompt_logprobs", "logprobs")
    logprobs: Count | None = Field(None, description=(
        "Alternatives a token, at most the server's --max-logprobs (vLLM's; default 20) and the vocabulary."))
    add_special_tokens: bool = Field(True, description="vLLM's: a text prompt is encoded with the tokenizer's "
                                                       "special tokens (a BOS where it adds one).")
    suffix: str | None = Field(None, description="Insertion is not served: only an empty suffix (or null).",
                               json_schema_extra={"anyOf": [{"type": "string", "maxLength": 0}, {"type": "null"}]})

    @classmethod
    def engine_fields(cls, limits: EngineLimits) -> dict[str, Any]:
        return {**super().engine_fields(limits),
                "prompt": (_prompt(limits), Field(description=_prompt_description(limits)))}


class ContentPart(BaseModel):
    # only text parts are served (another type, or one without its text, is refused with a 400)
    model_config = ConfigDict(extra="allow", strict=True, json_schema_extra={
        "required": ["type", "text"], "properties": {"type": {"enum": ["text"]}, "text": {"type": "string"}}})

    type: str
    text: Text | None = None


def _message_schema(schema: dict[str, Any]) -> None:
    """A message's document: its tool-call fields (kept as extras), and that null content is for an
    assistant message of tool_calls only (the server refuses it elsewhere; the document says so, so that
    clients and fuzzers read the same rule)."""
    schema["properties"].update({"tool_calls": {"type": ["array", "null"], "items": {
                                     "type": "object", "required": ["function"],
                                     "properties": {"function": {"type": "object"}}}},
                                 "tool_call_id": {"type": ["string", "null"]}})
    schema.update({"if": {"properties": {"content": {"type": "null"}}, "required": ["content"]},
                   "then": {"properties": {"role": {"const": "assistant"}, "tool_calls": {"type": "array",
                                                                                        "minItems": 1}},
                            "required": ["tool_calls"]}})


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True, json_schema_extra=_message_schema)

    role: str
    content: Text | list[ContentPart] | None = Field(
        description="Text, or a list of text parts (the only kind served); null for an assistant message of "
                    "tool_calls.")
    name: str | None = None


def _function(required: dict[str, type], optional: dict[str, type]) -> tuple[dict[str, Any], Any]:
    """OpenAI's ``{"type": "function", "function": {...}}`` object with these fields of the function (each a
    JSON type), as a JSON Schema and its validator."""
    names = {str: "string", dict: "object", bool: "boolean"}
    kinds = {**required, **optional}
    schema = {"type": "object", "required": ["type", "function"], "properties": {
        "type": {"const": "function"}, "function": {"type": "object", "required": list(required), "properties": {
            name: {"type": names[kind]} for name, kind in kinds.items()}}}}
    fields = [f'"{name}": {names[kind]}' for name, kind in required.items()]
    fields += [f'"{name}" (optional): {names[kind]}' for name, kind in optional.items()]
    shape = '{"type": "function", "function": {' + ", ".join(fields) + "}}"

    def check(value: Any) -> Any:
        function = value.get("function") if isinstance(value, dict) else None
        if not isinstance(function, dict) or value.get("type") != "function" or any(
                name not in function for name in required) or any(
                name in function and type(function[name]) is not kind for name, kind in kinds.items()):
            raise PydanticCustomError("function_object", "expected {shape}", {"shape": shape})
        return value

    return schema, check


_TOOL_SCHEMA, _tool = _function({"name": str}, {"description": str, "parameters": dict, "strict": bool})
_NAMED_SCHEMA, _named = _function({"name": str}, {})
TOOL_CHOICES = ("none", "auto", "required")


def _tool_choice(value: Any) -> Any:
    """One of ``TOOL_CHOICES``, or a named function."""
    if isinstance(value, str):
        if value not in TOOL_CHOICES:
            raise PydanticCustomError("tool_choice", "expected one of {choices} or a named function",
                                      {"choices": list(TOOL_CHOICES)})
        return value
    return _named(value)


#: OpenAI's tool (a function the model may call) and tool choice
Tool = Annotated[dict[str, Any], AfterValidator(_tool), WithJsonSchema(_TOOL_SCHEMA)]
ToolChoice = Annotated[str | dict[str, Any], AfterValidator(_tool_choice), WithJsonSchema(
    {"anyOf": [{"enum": list(TOOL_CHOICES)}, _NAMED_SCHEMA]})]


class ChatCompletionRequest(GenerationRequest):
    refused_extensions: ClassVar[dict[str, Any]] = {**UNSUPPORTED_EXTENSIONS, "echo": False,
                                                    "add_special_tokens": False}
    output_counts: ClassVar[tuple[str, ...]] = ("max_tokens", "max_completion_tokens")
    # what the endpoint refuses otherwise, the document says: top_logprobs other than 0 asks for logprobs=true; a
    # required or named tool_choice, for tools; continue_final_message, for add_generation_prompt=false;
    # prompt_logprobs, for no stream
    schema_rules: ClassVar[dict[str, Any]] = {"allOf": [_ONE_SWITCH, STREAMED_ONLY, {
        "if": {"properties": {"stream": {"const": True}}, "required": ["stream"]},
        "then": {"properties": {"prompt_logprobs": {"type": "null"}}}},
        {"if": {"properties": {"top_logprobs": ASKS_ALTERNATIVES}, "required": ["top_logprobs"]},
         "then": {"properties": {"logprobs": {"const": True}}, "required": ["logprobs"]}},
        {"if": {"properties": {"tool_choice": {"anyOf": [{"const": "required"}, {"type": "object"}]}},
                "required": ["tool_choice"]},
         "then": {"properties": {"tools": {"type": "array", "minItems": 1}}, "required": ["tools"]}}]}

    messages: list[ChatMessage] = Field(
        min_length=1, description="The conversation; rendered by the chat template, it must leave room for "
                                  "max_completion_tokens within the model's context.")
    max_completion_tokens: Count | None = None
    logprobs: bool | None = False
    logprob_counts: ClassVar[tuple[str, ...]] = ("prompt_logprobs", "top_logprobs")
    top_logprobs: Int | None = Field(None, description=(
        "With logprobs: alternatives a token, at most the server's --max-logprobs (vLLM's; default 20; -1 there also "
        "allows -1 here: the whole vocabulary)."))
    tools: list[Tool] | None = None
    tool_choice: ToolChoice | None = None
    parallel_tool_calls: bool | None = None
    functions: list[dict[str, Any]] | None = Field(
        None, json_schema_extra={"maxItems": 0}, description="Legacy function calling: not served (send tools).")
    function_call: str | dict[str, Any] | None = Field(
        None, json_schema_extra={"enum": ["none", None]}, description="Legacy: not served (send tool_choice).")
    chat_template_kwargs: dict[str, Any] | None = None  # vLLM's: extra variables for the chat template
    add_generation_prompt: bool = Field(True, description="vLLM's: open the assistant's turn after the messages.")
    continue_final_message: bool = Field(
        False, description="vLLM's: leave the final (assistant) message open, for the model to go on with it; "
                           "needs add_generation_prompt false.")


# ------------------------------------------------------------------------------ vLLM's tokenization
def _one_text(value: Any) -> Any:
    """/tokenize's prompt is one text (a batch, or ids, would be /v1/completions' forms)."""
    if value is not None and not isinstance(value, str):
        raise PydanticCustomError("tokenize_prompt", "expected one string, the text to tokenize")
    return value


class TokenizeRequest(BaseModel):
    """vLLM's ``/tokenize``: a ``prompt`` (the ids ``/v1/completions`` generates from) or ``messages``
    (those of ``/v1/chat/completions``), one of the two."""

    model_config = ConfigDict(strict=True, json_schema_extra={"oneOf": [
        {"required": ["prompt"], "properties": {"prompt": {"type": "string"}, "messages": {"type": "null"},
                                                "tools": {"type": "null"}}},
        {"required": ["messages"], "properties": {"messages": {"type": "array"}, "prompt": {"type": "null"}}}],
        "allOf": [_ONE_SWITCH, {
            "if": {"required": ["messages"]},
            "then": {"properties": {"add_special_tokens": {"enum": [False, None]}}}}]})

    model: str | None = None
    prompt: Annotated[Text, BeforeValidator(_one_text)] | None = None
    messages: list[ChatMessage] | None = Field(None, min_length=1)
    add_special_tokens: bool | None = Field(
        None, description="vLLM's: a prompt is encoded with the tokenizer's special tokens unless false, as in "
                          "/v1/completions; a conversation's come from its chat template only (true is refused).")
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template: None = None
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[Tool] | None = Field(None, description="With messages: rendered by the chat template, as a chat's.")
    return_token_strs: bool | None = False


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeRequest(BoundedModel):
    model_config = ConfigDict(strict=True)

    model: str | None = None
    tokens: TokenIds

    @classmethod
    def engine_fields(cls, limits: EngineLimits) -> dict[str, Any]:
        return {"tokens": (_token_ids(limits, 0), ...)}


class DetokenizeResponse(BaseModel):
    prompt: str


# ------------------------------------------------------------------------------------------- errors
class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None
    code: str | None


class ErrorResponse(BaseModel):
    """OpenAI's error shape: every error the server answers has it."""

    error: ErrorInfo
