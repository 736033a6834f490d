"""``POST /v1/responses``: OpenAI's Responses API as vLLM serves it, for text.

The ``input`` (a string, or messages of text parts) and ``instructions`` (a system message before them) go
through the chat template as a chat's messages do; the answer is a ``response`` object whose ``output`` holds
an assistant message (under a reasoning parser, the thinking block as a ``reasoning`` item before it; with
``tools``, each call the family's tool-call parser finds as a ``function_call`` item, and a former call and its
``function_call_output`` in the input go to the template as a chat's tool calls and tool message). Streamed, it is
OpenAI's typed events (``response.created`` ... ``response.output_text.delta`` ... ``response.completed``, each
with its ``sequence_number``; a call's arguments come whole in one delta, as chat streams them). ``text.format``
(json_object, json_schema) and vLLM's ``structured_outputs`` constrain the answer, ``tool_choice`` "required" or a
named function forces calls; the sampling fields and vLLM's extras are chat's. Nothing is stored (``store`` is
taken and changes nothing), so ``previous_response_id``, background responses, hosted tools and a reasoning
configuration are refused with a 400 naming them. ``include: ["message.output_text.logprobs"]`` (with
``top_logprobs``) gives the answer's token logprobs, as chat's, where no reasoning parser or tool splits the output.
"""
from __future__ import annotations

import contextlib
import uuid
from typing import Any, AsyncIterator, Callable

from fastapi import Request
from fastapi.responses import JSONResponse, Response
from vtcore.server.chat import check_tools_served, forced_tools, render_chat
from vtcore.server.errors import APIError, to_api_error
from vtcore.server.generation import Choice, Delta, GenerationEndpoint, Job, Prompts
from vtcore.server.protocol import ChatMessage
from vtcore.server.reasoning import ThinkSplitter, split_reasoning
from vtcore.server.responses_protocol import (FunctionCallItem, FunctionCallOutputItem, InputMessage, NamedFunction,
                                              ResponsesRequest)
from vtcore.server.serving import Serving
from vtcore.server.tool_calls import CallStream, forced_calls, split_calls
from vtcore.server.sse import EventStream, compact_json
from vtcore.server.structured import checked, structured_outputs
from vtcore.structured import StructuredOutputsParams
from vtcore.structured.grammar import after_thinking


def _new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def _event(kind: str, seq: int, **fields: Any) -> bytes:
    data = compact_json({"type": kind, "sequence_number": seq, **fields})
    return b"event: " + kind.encode() + b"\ndata: " + data + b"\n\n"


class ResponsesEndpoint(GenerationEndpoint[ResponsesRequest]):
    id_prefix = "resp"
    id_separator = "_"
    object = "response"
    chunk_object = "response"

    def __init__(self, serving: Serving, reasoning_parser: type[ThinkSplitter] | None = None) -> None:
        super().__init__(serving)
        self.reasoning_parser = reasoning_parser
        self.tool_parser = self.engine.tool_parser()  # the served family's, asked of the plugins once

    def check(self, body: ResponsesRequest) -> None:
        if body.return_token_ids:
            raise APIError(400, "return_token_ids=true: not served on /v1/responses (use /v1/chat/completions)",
                           "return_token_ids", "unsupported")
        check_tools_served(self, body.tools)
        self.forced(body)  # a bad tool_choice is a 400 before anything runs
        if body.top_logprobs not in (None, 0) and not self.wants_logprobs(body):
            raise APIError(400, "top_logprobs: requires include ['message.output_text.logprobs']", "top_logprobs")
        if self.wants_logprobs(body) and (self.reasoning_parser is not None or self.offered(body) is not None):
            raise APIError(400, "include: the answer's logprobs are not served beside a reasoning parser or tools "
                                "(their tokens would not be told apart from the answer's)", "include", "unsupported")

    @staticmethod
    def wants_logprobs(body: ResponsesRequest) -> bool:
        return bool(body.include) and "message.output_text.logprobs" in body.include

    def forced(self, body: ResponsesRequest) -> list[dict[str, Any]] | None:
        """The tools (chat form) ``tool_choice`` forces a call of (``chat.forced_tools``)."""
        choice = body.tool_choice
        named = isinstance(choice, NamedFunction)
        return forced_tools(choice.model_dump() if named else choice, choice.name if named else None,
                            [t.as_chat_tool() for t in body.tools or ()])

    def sampling(self, body: ResponsesRequest) -> tuple[dict[str, Any], dict[str, str]]:
        given = body.max_output_tokens is not None
        kw: dict[str, Any] = {"max_tokens": body.max_output_tokens if given else body.max_tokens}
        if self.wants_logprobs(body):
            kw["logprobs"] = body.top_logprobs or 0
        fmt = body.text.format if body.text is not None else None
        asked = [name for name, on in (("text.format", fmt is not None and fmt.type != "text"), (
            "structured_outputs", (body.model_extra or {}).get("structured_outputs") is not None), (
            "tool_choice", self.forced(body) is not None)) if on]
        if len(asked) > 1:
            raise APIError(400, f"{' and '.join(asked)} each set the output's form; send one", asked[-1])
        constraint = structured_outputs(body)
        if fmt is not None and fmt.type == "json_schema" and fmt.schema_ is None:
            raise APIError(400, "text.format.schema: a json_schema format needs its schema (an object)",
                           "text.format.schema")
        if fmt is not None and fmt.type != "text":
            constraint = StructuredOutputsParams(json_object=True) if fmt.type == "json_object" else \
                checked(StructuredOutputsParams(json=fmt.schema_), "text.format.schema")
        forced = self.forced(body)
        if forced is not None:  # "required": one call or more (unless parallel_tool_calls is false); named: one
            many = body.tool_choice == "required" and body.parallel_tool_calls is not False
            constraint = forced_calls(self.tool_parser, forced, many)
        if constraint is not None:
            parser = self.reasoning_parser
            kw["structured_outputs"] = constraint if parser is None else after_thinking(constraint, parser.START,
                                                                                        parser.END)
        return kw, {"max_tokens": "max_output_tokens" if given else "max_tokens", "logprobs": "top_logprobs"}

    def prompts(self, body: ResponsesRequest) -> Prompts:
        items = [InputMessage(role="user", content=body.input)] if isinstance(body.input, str) else body.input
        messages = [ChatMessage(role="system", content=body.instructions)] if body.instructions is not None else []
        for item in items:
            if isinstance(item, FunctionCallOutputItem):
                messages.append(ChatMessage(role="tool", content=item.output, tool_call_id=item.call_id))
            elif isinstance(item, FunctionCallItem):
                call = {"id": item.call_id, "type": "function",
                        "function": {"name": item.name, "arguments": item.arguments}}
                if messages and messages[-1].role == "assistant":  # one turn: its text, then its calls
                    messages[-1].model_extra.setdefault("tool_calls", []).append(call)
                else:
                    messages.append(ChatMessage(role="assistant", content=None, tool_calls=[call]))
            else:
                text = item.content if isinstance(item.content, str) else "\n".join(p.text for p in item.content)
                messages.append(ChatMessage(role="system" if item.role == "developer" else item.role, content=text))
        tools = [t.as_chat_tool() for t in body.tools or ()] if body.tool_choice != "none" else None
        prompt = render_chat(self.engine, messages, body.chat_template_kwargs, tools or None,
                             chat_template=self.serving.chat_template)
        return Prompts([(prompt["prompt"], prompt["prompt_token_ids"])], "input")

    def offered(self, body: ResponsesRequest) -> list[dict[str, Any]] | None:
        """The tools (chat form) whose calls the output is parsed for, or None (none offered)."""
        return [t.as_chat_tool() for t in body.tools] if body.tools and body.tool_choice != "none" else None

    def response_choice(self, body: ResponsesRequest, choice: Choice) -> dict[str, Any]:
        """The output items of the response's one choice: its reasoning (under a parser, when it thought), its
        message, and its calls (with tools)."""
        reasoning, content = None, choice.text
        if self.reasoning_parser is not None:
            reasoning, content = split_reasoning(self.reasoning_parser(), choice.text)
        calls: list[tuple[str, str]] = []
        tools = self.offered(body)
        if tools is not None:
            content, calls = split_calls(self.tool_parser, content, tools)
        status = _item_status(choice.finish_reason)
        items = [] if reasoning is None else [_reasoning_item(_new_id("rs"), reasoning)]
        if content or not calls:
            logprobs = self.token_entries(choice.token_ids, choice.logprobs, body.top_logprobs or 0,
                                          self.tokens_as_ids(body)) if self.wants_logprobs(body) else None
            items.append(_message_item(_new_id("msg"), content, status, logprobs))
        return {"output": items + [_call_item(_new_id("fc"), name, args) for name, args in calls]}

    def stream(self, body: ResponsesRequest) -> _OutputEvents:
        tools = self.offered(body)
        k = body.top_logprobs or 0
        as_ids = self.tokens_as_ids(body)
        entries = (lambda d: self.token_entries(d.token_ids, d.logprobs, k, as_ids)) if self.wants_logprobs(body) \
            else None
        return _OutputEvents(self.reasoning_parser, None if tools is None else CallStream(self.tool_parser, tools),
                             entries)

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
        """The ``response`` object: in progress (no ``choice`` yet), or done with ``output`` (completed; incomplete
        at its length; cancelled when aborted, as vLLM says), echoing the sampling values it ran with."""
        finish = None if choice is None else choice.finish_reason
        status = "in_progress" if choice is None else _RESPONSE_STATUS.get(finish, "completed")
        fmt = body.text.format if body.text is not None and body.text.format is not None else None
        choice_field = body.tool_choice.model_dump() if isinstance(body.tool_choice, NamedFunction) else (
            body.tool_choice or "auto")
        params = job.prompts[0].params
        counts = job.usage()
        return {
            "id": job.id, "object": "response", "created_at": job.created, "status": status, "background": False,
            "error": None, "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
            "instructions": body.instructions,
            "max_output_tokens": body.max_tokens if body.max_output_tokens is None else body.max_output_tokens,
            "max_tool_calls": None, "metadata": body.metadata or {}, "model": self.serving.model_name(body.model),
            "output": output,
            "parallel_tool_calls": body.parallel_tool_calls is not False, "previous_response_id": None,
            "reasoning": None, "store": False, "temperature": params.temperature, "top_p": params.top_p,
            "text": {"format": fmt.model_dump(by_alias=True, exclude_none=True) if fmt else {"type": "text"}},
            "tool_choice": choice_field, "tools": [t.model_dump(exclude_none=True) for t in body.tools or ()],
            "top_logprobs": body.top_logprobs or 0, "truncation": "disabled", "user": body.user,
            "usage": None if choice is None else {
                "input_tokens": counts["prompt_tokens"], "output_tokens": counts["completion_tokens"],
                "total_tokens": counts["total_tokens"], "input_tokens_details": counts["prompt_tokens_details"],
                "output_tokens_details": {"reasoning_tokens": self.reasoning_tokens(choice.token_ids)}}}

    def reasoning_tokens(self, token_ids: list[int]) -> int:
        """The output's tokens of its thinking block, the tags included (under a reasoning parser whose tags are
        one token each: an output that begins with the start tag thinks up to the end tag, or to its end)."""
        parser, tokenizer = self.reasoning_parser, self.engine.tokenizer
        if parser is None or tokenizer is None or not token_ids:
            return 0
        start, end = (tokenizer.convert_tokens_to_ids(tag) for tag in (parser.START, parser.END))
        if token_ids[0] != start or start == tokenizer.unk_token_id:
            return 0
        return token_ids.index(end) + 1 if end in token_ids else len(token_ids)

    async def events(self, body: ResponsesRequest, job: Job) -> AsyncIterator[bytes]:
        """OpenAI's Responses events: created, in_progress, each output item's (added, its deltas, done), then
        completed (as vLLM ends every stream, an output cut at its length too: its response says incomplete).
        Nothing is sent before the engine's first output, so a request the engine refuses is a plain error
        response; a failure after that is an ``error`` event, the stream's last."""
        seq = iter(range(1 << 62))
        stream = self.stream(body)
        async with contextlib.aclosing(self.merged(job)) as it:
            first = await anext(it, None)
            start = self.response(body, job, None, [])
            yield _event("response.created", next(seq), response=start)
            yield _event("response.in_progress", next(seq), response=start)
            try:
                choice = None
                if first is not None:
                    choice, delta = first
                    for kind, fields in stream.chunks(choice, delta):
                        yield _event(kind, next(seq), **fields)
                async for choice, delta in it:
                    for kind, fields in stream.chunks(choice, delta):
                        yield _event(kind, next(seq), **fields)
            except Exception as exc:  # noqa: BLE001 - after the headers: the stream's last event says it
                err = to_api_error(exc, job.renames)
                yield _event("error", next(seq), code=err.code, message=err.message, param=err.param)
                return
        assert choice is not None  # (a request's output always ends with a finish reason)
        for kind, fields in stream.close(choice.finish_reason):
            yield _event(kind, next(seq), **fields)
        yield _event("response.completed", next(seq), response=self.response(body, job, choice, stream.items))


#: a finished output's response status by its finish reason (a call's, like an answer's, is "stop")
_RESPONSE_STATUS = {"stop": "completed", "length": "incomplete", "abort": "cancelled"}


def _item_status(finish_reason: str | None) -> str:
    """An output item's status: completed, or incomplete (cut at its length, or aborted)."""
    return "completed" if finish_reason == "stop" else "incomplete"


def _reasoning_item(item_id: str, text: str) -> dict[str, Any]:
    return {"id": item_id, "type": "reasoning", "summary": [], "content": [{"type": "reasoning_text", "text": text}],
            "status": "completed"}


def _message_item(item_id: str, text: str | None, status: str, logprobs: list | None = None) -> dict[str, Any]:
    content = [] if text is None else [_message_part(text, logprobs)]
    return {"id": item_id, "type": "message", "status": status, "role": "assistant", "content": content}


def _message_part(text: str, logprobs: list | None = None) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": logprobs or []}


def _call_item(item_id: str, name: str, arguments: str) -> dict[str, Any]:
    return {"id": item_id, "type": "function_call", "status": "completed", "call_id": _new_id("call"), "name": name,
            "arguments": arguments}


class _OutputEvents:
    """A streamed response's output items in order: the reasoning item (under a parser, while the output thinks),
    message items, and a ``function_call`` item for each call the call stream completes (its arguments whole in
    one delta); each opened with its ``added`` events and closed with its ``done`` ones. ``chunks`` gives a
    delta's events, ``close`` the last ones; ``items`` is the finished output (an answer of calls only has no
    message item, as the whole response's). ``entries``: a delta's token logprobs for its text delta (asked for
    only with neither a parser nor calls, so every token is the message's)."""

    def __init__(self, parser: type[ThinkSplitter] | None, calls: CallStream | None = None,
                 entries: Callable[[Delta], list[dict[str, Any]]] | None = None) -> None:
        self.splitter = parser() if parser is not None else None
        self.calls = calls
        self.entries = entries
        self.logprobs: list[dict[str, Any]] = []  # the open message's
        self.items: list[dict[str, Any]] = []
        self.open: str | None = None  # "reasoning" or "message"
        self.text = ""
        self.called = False
        self.blank = ""  # white space with no message open: a message's start, or (before or after calls) nothing

    def chunks(self, choice: Choice | None, delta: Delta) -> list[tuple[str, dict[str, Any]]]:
        if self.entries is not None:
            return self._message(delta.text, logprobs=self.entries(delta))
        reasoning, content = ("", delta.text) if self.splitter is None else self.splitter.feed(delta.text)
        return self._parts(reasoning, content)

    def close(self, finish_reason: str | None) -> list[tuple[str, dict[str, Any]]]:
        events = self._parts(*self.splitter.flush()) if self.splitter is not None else []
        if self.calls is not None:
            rest, calls = self.calls.flush()
            events += self._message(rest) + self._calls(calls)
        if not self.called and self.open != "message" and not any(i["type"] == "message" for i in self.items):
            events += self._switch("message")  # (an empty answer still has its message)
            events += self._message(self.blank, force=True)
        return events + (self._close(_item_status(finish_reason)) if self.open else [])

    def _parts(self, reasoning: str, content: str) -> list[tuple[str, dict[str, Any]]]:
        events = []
        if reasoning:
            if self.open != "reasoning":
                events += self._switch("reasoning")
            self.text += reasoning
            events.append(("response.reasoning_text.delta", {**self._where(), "delta": reasoning}))
        if self.calls is None:
            return events + self._message(content)
        text, calls = self.calls.feed(content)
        return events + self._message(text) + self._calls(calls)

    def _message(self, text: str, force: bool = False, logprobs: list | None = None
                 ) -> list[tuple[str, dict[str, Any]]]:
        """A content delta: with calls possible, white space opens no message (as the whole response's content is
        stripped around calls) until text follows."""
        if self.calls is not None and self.open != "message" and not force:
            text, self.blank = self.blank + text, ""
            if not text.strip():
                self.blank = text
                return []
        if not text and not logprobs:
            return []
        events = self._switch("message") if self.open != "message" else []
        self.text += text
        self.logprobs += logprobs or []
        return events + [("response.output_text.delta", {**self._where(), "delta": text, "logprobs": logprobs or []})]

    def _calls(self, calls: list[tuple[str, str]]) -> list[tuple[str, dict[str, Any]]]:
        events = []
        for name, arguments in calls:
            self.blank = ""
            if self.open is not None:
                events += self._close("completed")
            item = _call_item(_new_id("fc"), name, arguments)
            index = len(self.items)
            self.items.append(item)
            self.called = True
            where = {"item_id": item["id"], "output_index": index}
            events += [("response.output_item.added", {"output_index": index,
                                                       "item": {**item, "arguments": "", "status": "in_progress"}}),
                       ("response.function_call_arguments.delta", {**where, "delta": arguments}),
                       ("response.function_call_arguments.done", {**where, "name": name, "arguments": arguments}),
                       ("response.output_item.done", {"output_index": index, "item": item})]
        return events

    def _where(self) -> dict[str, Any]:
        return {"item_id": self.items[-1]["id"], "output_index": len(self.items) - 1, "content_index": 0}

    def _switch(self, kind: str) -> list[tuple[str, dict[str, Any]]]:
        events = self._close("completed") if self.open is not None else []
        item = _reasoning_item(_new_id("rs"), "") if kind == "reasoning" else _message_item(_new_id("msg"), "", "")
        item["status"], item["content"] = "in_progress", []
        self.items.append(item)
        self.open, self.text, self.logprobs = kind, "", []
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
            done = _message_item(item["id"], self.text, status, self.logprobs)
            events = [("response.output_text.done", {**where, "text": self.text, "logprobs": self.logprobs}),
                      ("response.content_part.done", {**where, "part": _message_part(self.text, self.logprobs)})]
        self.items[-1] = done
        self.open = None
        return events + [("response.output_item.done", {"output_index": where["output_index"], "item": done})]
