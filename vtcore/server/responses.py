"""``POST /v1/responses``: OpenAI's Responses API as vLLM serves it, for text.

The ``input`` (a string, or messages of text parts) and ``instructions`` (a system message before them) go
through the chat template as a chat's messages do; the answer is a ``response`` object whose ``output`` holds
one assistant message (and, under a reasoning parser, the thinking block as a ``reasoning`` item before it).
Streamed, it is OpenAI's typed events (``response.created`` ... ``response.output_text.delta`` ...
``response.completed``, each with its ``sequence_number``). ``text.format`` (json_object, json_schema) and vLLM's
``structured_outputs`` constrain the answer; the sampling fields and vLLM's extras are chat's. Nothing is stored
(``store`` is taken and changes nothing), so ``previous_response_id``, background responses, tools, ``include``
and a reasoning configuration are refused with a 400 naming them.
"""
from __future__ import annotations

import contextlib
import json
import uuid
from typing import Annotated, Any, AsyncIterator, ClassVar, Literal

from fastapi import Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ConfigDict, Field

from vtcore.server.chat import render_chat
from vtcore.server.errors import APIError
from vtcore.server.generation import Choice, Delta, GenerationEndpoint, Job, Prompts
from vtcore.server.protocol import UNSUPPORTED_EXTENSIONS, ChatMessage, Count, GenerationRequest, Text
from vtcore.server.reasoning import ThinkSplitter, split_reasoning
from vtcore.server.serving import Serving
from vtcore.server.sse import EventStream
from vtcore.server.structured import structured_outputs
from vtcore.structured import StructuredOutputsParams
from vtcore.structured.grammar import after_thinking


class InputPart(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)

    type: Literal["input_text", "output_text"] = Field(description="Text parts only (the kind served).")
    text: Text


class InputMessage(BaseModel):
    """A message of the input (``type`` "message" or left out); an assistant's may be a former response's output."""

    model_config = ConfigDict(extra="allow", strict=True)

    type: Literal["message"] | None = None
    role: Literal["user", "system", "developer", "assistant"]
    content: Text | list[InputPart]


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
        **UNSUPPORTED_EXTENSIONS, "previous_response_id": None, "background": False, "include": [], "prompt": None,
        "reasoning": None, "truncation": "disabled", "max_tool_calls": None, "top_logprobs": 0, "conversation": None}
    refusal_reasons: ClassVar[dict[str, str]] = {
        "previous_response_id": "no response is stored here to continue from (send the conversation as input)",
        "conversation": "no conversation is stored here (send it as input)",
        "background": "background responses are not served (nothing is stored to poll)",
        "include": "no extra output is served", "prompt": "stored prompt templates are not served",
        "reasoning": "reasoning settings are not served",
        "truncation": "the input is never truncated here", "max_tool_calls": "tools are not served here",
        "top_logprobs": "logprobs are not served on /v1/responses (use /v1/chat/completions)"}
    output_counts: ClassVar[tuple[str, ...]] = ("max_tokens", "max_output_tokens")

    input: Text | Annotated[list[InputMessage], Field(min_length=1)] = Field(
        description="Text (a user message), or messages of text parts; rendered by the chat template after the "
                    "instructions.")
    instructions: Text | None = Field(None, description="A system message before the input.")
    max_output_tokens: Count | None = None
    text: TextConfig | None = None
    n: int | None = Field(1, ge=1, le=1, description="One output a response.")
    response_format: None = Field(None, description="Chat's; here text.format.")
    prompt_logprobs: None = Field(None, description="Chat's and completions'; not served here.")
    return_token_ids: bool | None = Field(None, json_schema_extra={"enum": [False, None]},
                                          description="Chat's and completions'; not served here.")
    tools: list[dict[str, Any]] | None = Field(None, max_length=0, description="Tools are not served here.")
    tool_choice: Literal["none", "auto"] | None = None
    parallel_tool_calls: bool | None = None
    store: bool | None = Field(None, description="Taken; no response is kept (nothing to retrieve or continue).")
    metadata: dict[str, str] | None = Field(None, max_length=16, description="Echoed in the response.")


def _new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def _event(kind: str, seq: int, **fields: Any) -> str:
    data = json.dumps({"type": kind, "sequence_number": seq, **fields}, ensure_ascii=False)
    return f"event: {kind}\ndata: {data}\n\n"


class ResponsesEndpoint(GenerationEndpoint[ResponsesRequest]):
    id_prefix = "resp"
    id_separator = "_"
    object = "response"
    chunk_object = "response"

    def __init__(self, serving: Serving, reasoning_parser: type[ThinkSplitter] | None = None) -> None:
        super().__init__(serving)
        self.reasoning_parser = reasoning_parser

    def check(self, body: ResponsesRequest) -> None:
        if body.return_token_ids:
            raise APIError(400, "return_token_ids=true: not served on /v1/responses (use /v1/chat/completions)",
                           "return_token_ids", "unsupported")

    def sampling(self, body: ResponsesRequest) -> tuple[dict[str, Any], dict[str, str]]:
        given = body.max_output_tokens is not None
        kw: dict[str, Any] = {"max_tokens": body.max_output_tokens if given else body.max_tokens}
        fmt = body.text.format if body.text is not None else None
        constraint = None
        if fmt is not None and fmt.type != "text":
            if (body.model_extra or {}).get("structured_outputs") is not None:
                raise APIError(400, "text.format and structured_outputs both constrain the output; send one",
                               "structured_outputs")
            if fmt.type == "json_schema" and fmt.schema_ is None:
                raise APIError(400, "text.format.schema: a json_schema format needs its schema (an object)",
                               "text.format.schema")
            constraint = StructuredOutputsParams(json_object=True) if fmt.type == "json_object" else \
                StructuredOutputsParams(json=fmt.schema_)
        constraint = constraint or structured_outputs(body)
        if constraint is not None:
            parser = self.reasoning_parser
            kw["structured_outputs"] = constraint if parser is None else after_thinking(constraint, parser.START,
                                                                                        parser.END)
        return kw, {"max_tokens": "max_output_tokens" if given else "max_tokens"}

    def prompts(self, body: ResponsesRequest) -> Prompts:
        items = [InputMessage(role="user", content=body.input)] if isinstance(body.input, str) else body.input
        messages = [ChatMessage(role="system", content=body.instructions)] if body.instructions is not None else []
        for m in items:
            text = m.content if isinstance(m.content, str) else "\n".join(p.text for p in m.content)
            messages.append(ChatMessage(role="system" if m.role == "developer" else m.role, content=text))
        prompt = render_chat(self.engine, messages, None, chat_template=self.serving.chat_template)
        return Prompts([(prompt["prompt"], prompt["prompt_token_ids"])], "input")

    def response_choice(self, body: ResponsesRequest, choice: Choice) -> dict[str, Any]:
        """The output items of the response's one choice: its reasoning (under a parser, when it thought) and its
        message."""
        reasoning, content = None, choice.text
        if self.reasoning_parser is not None:
            reasoning, content = split_reasoning(self.reasoning_parser(), choice.text)
        status = "completed" if choice.finish_reason == "stop" else "incomplete"
        items = [] if reasoning is None else [_reasoning_item(_new_id("rs"), reasoning)]
        return {"output": items + [_message_item(_new_id("msg"), content, status)]}

    def stream(self, body: ResponsesRequest) -> _OutputEvents:
        return _OutputEvents(self.reasoning_parser)

    async def __call__(self, body: ResponsesRequest, request: Request) -> Response:
        job = await self.serving.off_loop(self.prepare, body)
        if body.stream:
            return EventStream(self.events(body, job))
        if not await self.run_to_end(job, request):
            return Response(status_code=499)
        choice = job.choices[0]
        return JSONResponse(self.response(body, job, choice, self.response_choice(body, choice)["output"]))

    def response(self, body: ResponsesRequest, job: Job, choice: Choice | None,
                 output: list[dict[str, Any]]) -> dict[str, Any]:
        """The ``response`` object: in progress (no ``choice`` yet), or done with ``output``."""
        finish = None if choice is None else choice.finish_reason
        status = "in_progress" if choice is None else "completed" if finish == "stop" else "incomplete"
        fmt = body.text.format if body.text is not None and body.text.format is not None else None
        counts = job.usage()
        return {
            "id": job.id, "object": "response", "created_at": job.created, "status": status, "background": False,
            "error": None, "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
            "instructions": body.instructions, "max_output_tokens": body.max_output_tokens, "max_tool_calls": None,
            "metadata": body.metadata or {}, "model": self.serving.name, "output": output,
            "parallel_tool_calls": body.parallel_tool_calls is not False, "previous_response_id": None,
            "reasoning": None, "store": False, "temperature": body.temperature, "top_p": body.top_p,
            "text": {"format": fmt.model_dump(by_alias=True, exclude_none=True) if fmt else {"type": "text"}},
            "tool_choice": body.tool_choice or "auto", "tools": [], "top_logprobs": 0, "truncation": "disabled",
            "user": body.user,
            "usage": None if choice is None else {
                "input_tokens": counts["prompt_tokens"], "output_tokens": counts["completion_tokens"],
                "total_tokens": counts["total_tokens"], "input_tokens_details": counts["prompt_tokens_details"],
                "output_tokens_details": {"reasoning_tokens": 0}}}

    async def events(self, body: ResponsesRequest, job: Job) -> AsyncIterator[str]:
        """OpenAI's Responses events: created, in_progress, each output item's (added, its deltas, done), then
        completed (as vLLM ends every stream, an output cut at its length too: its response says incomplete)."""
        seq = iter(range(1 << 62))
        start = self.response(body, job, None, [])
        yield _event("response.created", next(seq), response=start)
        yield _event("response.in_progress", next(seq), response=start)
        stream = self.stream(body)
        choice = None
        async with contextlib.aclosing(self.merged(job)) as it:
            async for choice, delta in it:
                for kind, fields in stream.chunks(choice, delta):
                    yield _event(kind, next(seq), **fields)
        assert choice is not None  # (a request's output always ends with a finish reason)
        for kind, fields in stream.close(choice.finish_reason):
            yield _event(kind, next(seq), **fields)
        yield _event("response.completed", next(seq), response=self.response(body, job, choice, stream.items))


def _reasoning_item(item_id: str, text: str) -> dict[str, Any]:
    return {"id": item_id, "type": "reasoning", "summary": [], "content": [{"type": "reasoning_text", "text": text}],
            "status": "completed"}


def _message_item(item_id: str, text: str | None, status: str) -> dict[str, Any]:
    content = [] if text is None else [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}]
    return {"id": item_id, "type": "message", "status": status, "role": "assistant", "content": content}


class _OutputEvents:
    """A streamed response's output items: the reasoning item (under a parser, while the output thinks), then
    the message; each opened with its ``added`` events and closed with its ``done`` ones. ``chunks`` gives a
    delta's events, ``close`` the last ones; ``items`` is the finished output."""

    def __init__(self, parser: type[ThinkSplitter] | None) -> None:
        self.splitter = parser() if parser is not None else None
        self.items: list[dict[str, Any]] = []
        self.open: str | None = None  # "reasoning" or "message"
        self.text = ""

    def chunks(self, choice: Choice, delta: Delta) -> list[tuple[str, dict[str, Any]]]:
        reasoning, content = ("", delta.text) if self.splitter is None else self.splitter.feed(delta.text)
        return self._parts(reasoning, content)

    def close(self, finish_reason: str | None) -> list[tuple[str, dict[str, Any]]]:
        events = self._parts(*self.splitter.flush()) if self.splitter is not None else []
        if self.open is None or self.open == "reasoning":  # (an answer may be empty: its message still comes)
            events += self._switch("message")
        return events + self._close("completed" if finish_reason == "stop" else "incomplete")

    def _parts(self, reasoning: str, content: str) -> list[tuple[str, dict[str, Any]]]:
        events = []
        for kind, text in (("reasoning", reasoning), ("message", content)):
            if text:
                if self.open != kind:
                    events += self._switch(kind)
                self.text += text
                where = self._where()
                events.append(("response.reasoning_text.delta" if kind == "reasoning" else "response.output_text.delta",
                               {**where, "delta": text, **({} if kind == "reasoning" else {"logprobs": []})}))
        return events

    def _where(self) -> dict[str, Any]:
        return {"item_id": self.items[-1]["id"], "output_index": len(self.items) - 1, "content_index": 0}

    def _switch(self, kind: str) -> list[tuple[str, dict[str, Any]]]:
        events = self._close("completed") if self.open is not None else []
        item = _reasoning_item(_new_id("rs"), "") if kind == "reasoning" else _message_item(_new_id("msg"), "", "")
        item["status"], item["content"] = "in_progress", []
        self.items.append(item)
        self.open, self.text = kind, ""
        events.append(("response.output_item.added", {"output_index": len(self.items) - 1, "item": dict(item)}))
        if kind == "message":
            events.append(("response.content_part.added", {**self._where(), "part": _message_part("")}))
        return events

    def _close(self, status: str) -> list[tuple[str, dict[str, Any]]]:
        where, item = self._where(), self.items[-1]
        if self.open == "reasoning":
            done = _reasoning_item(item["id"], self.text)
            events = [("response.reasoning_text.done", {**where, "text": self.text})]
        else:
            done = _message_item(item["id"], self.text, status)
            events = [("response.output_text.done", {**where, "text": self.text, "logprobs": []}),
                      ("response.content_part.done", {**where, "part": _message_part(self.text)})]
        self.items[-1] = done
        self.open = None
        return events + [("response.output_item.done", {"output_index": where["output_index"], "item": done})]


def _message_part(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}
