"""``POST /v1/chat/completions``: a conversation through the chat template (``render_chat``, which
``/tokenize`` shares; the server's ``--chat-template``, ``load_chat_template``, else the tokenizer's), text
content only; tools through the family's tool-call parser; OpenAI's chat logprobs form; with a reasoning
parser (:mod:`vtcore.server.reasoning`) the thinking block as ``reasoning_content``."""
from __future__ import annotations

import json
import os
from typing import Any

from vtcore.engine.front_end import EngineFrontEnd
from vtcore.engine.prompt_text import TEMPLATE_ARGUMENTS, UnsupportedContent, message_text
from vtcore.outputs import PositionLogprobs
from vtcore.server.errors import APIError
from vtcore.server.generation import Choice, Delta, GenerationEndpoint, Job, Prompts
from vtcore.server.protocol import ChatCompletionRequest, ChatMessage
from vtcore.server.reasoning import ThinkSplitter, split_reasoning
from vtcore.server.tool_calls import CallStream, call_id, forced_calls, split_calls
from vtcore.server.structured import structured_outputs
from vtcore.structured.grammar import after_thinking
from vtcore.server.serving import Serving


def load_chat_template(value: str) -> str:
    """``--chat-template`` as vLLM takes it: a file's path (its text), or the Jinja template itself; a
    template that does not parse is refused here, before the model loads, with Jinja's reason."""
    import jinja2

    is_file = os.path.isfile(value)
    if not is_file and not any(mark in value for mark in ("{{", "{%")):
        raise ValueError(f"--chat-template {value!r}: no such file, and not a Jinja template (no '{{{{' or '{{%')")
    if is_file:
        with open(value, encoding="utf-8") as f:
            template = f.read()
    else:
        template = value
    try:
        jinja2.Environment().parse(template)
    except jinja2.TemplateSyntaxError as exc:
        where = value if is_file else "the template given"
        raise ValueError(f"--chat-template: {where}, line {exc.lineno}: {exc.message}") from None
    return template


def check_switches(add_generation_prompt: bool, continue_final_message: bool) -> None:
    """At most one of the chat template's switches (``/tokenize`` checks them for a prompt too, as its
    document says)."""
    if add_generation_prompt and continue_final_message:
        raise APIError(400, "continue_final_message: true with add_generation_prompt true; expected at most one "
                            "of them (go on with the final message, or open the assistant's turn)",
                       "continue_final_message")


def render_chat(engine: EngineFrontEnd, messages: list[ChatMessage], template_kwargs: dict[str, Any] | None,
                tools: list[dict[str, Any]] | None = None, *, chat_template: str | None = None,
                add_generation_prompt: bool = True, continue_final_message: bool = False) -> dict[str, Any]:
    """``{"prompt": text, "prompt_token_ids": ids}`` of a conversation through the chat template
    (``chat_template``: the server's ``--chat-template``, else the tokenizer's; text parts joined by newlines;
    ``tools`` and the messages' ``tool_calls`` / ``tool_call_id`` passed to it; vLLM's
    ``add_generation_prompt`` / ``continue_final_message``); what is wrong with it is an APIError naming
    the field."""
    conversation = []
    for i, m in enumerate(messages):
        extra = m.model_extra or {}
        try:
            content = message_text(i, m.role, m.content, extra.get("tool_calls"))
        except UnsupportedContent as exc:
            raise APIError(400, str(exc), "messages", "unsupported") from None
        except ValueError as exc:
            raise APIError(400, str(exc), "messages") from None
        msg: dict[str, Any] = {"role": m.role, "content": content}
        if m.name is not None:
            msg["name"] = m.name
        if extra.get("tool_calls") is not None:
            msg["tool_calls"] = _template_calls(extra["tool_calls"])
        if extra.get("tool_call_id") is not None:
            if not isinstance(extra["tool_call_id"], str):
                raise APIError(400, f"messages[{i}].tool_call_id={extra['tool_call_id']!r}: expected the id (a string) "
                                    "of the call this message answers", "messages")
            msg["tool_call_id"] = extra["tool_call_id"]
        conversation.append(msg)
    # (a request sets the switches and tools by their own fields: through the variables, a custom template would
    # get round those fields' checks)
    reserved = sorted(set(template_kwargs or {}) & TEMPLATE_ARGUMENTS)
    if reserved:
        raise APIError(400, f"chat_template_kwargs: {reserved[0]!r} is not a template variable the server lets a "
                            "request set", "chat_template_kwargs", "unsupported")
    check_switches(add_generation_prompt, continue_final_message)
    try:
        return engine.chat_prompt(conversation, chat_template=chat_template,
                                  add_generation_prompt=add_generation_prompt,
                                  continue_final_message=continue_final_message, **(template_kwargs or {}),
                                  **({"tools": tools} if tools else {}))
    except Exception as exc:  # noqa: BLE001 - the template rejected the conversation
        raise APIError(400, f"messages: the chat template failed: {type(exc).__name__}: {exc}", "messages") from None


def _template_calls(calls: Any) -> Any:
    """An assistant message's OpenAI tool calls as chat templates read them: the function, its arguments
    parsed from their JSON text (Qwen's templates write a dict as JSON, a string as it is)."""
    if not isinstance(calls, list):
        raise APIError(400, f"messages: tool_calls={calls!r}: expected a list of tool calls", "messages")
    out = []
    for i, call in enumerate(calls):
        fn = call.get("function") if isinstance(call, dict) else None
        if not isinstance(fn, dict):
            raise APIError(400, f"messages: tool_calls[{i}]={call!r:.80}: expected a tool call object {{'id': ..., "
                                "'type': 'function', 'function': {'name': ..., 'arguments': ...}}", "messages")
        args = fn.get("arguments", "{}")
        try:
            args = json.loads(args) if isinstance(args, str) else args
        except json.JSONDecodeError:
            pass  # the template writes the text as it came
        out.append({**call, "function": {**fn, "arguments": args}, "name": fn.get("name"), "arguments": args})
    return out


class ChatEndpoint(GenerationEndpoint[ChatCompletionRequest]):
    id_prefix = "chatcmpl"
    object = "chat.completion"
    chunk_object = "chat.completion.chunk"

    def __init__(self, serving: Serving, reasoning_parser: type[ThinkSplitter] | None = None) -> None:
        super().__init__(serving)
        self.reasoning_parser = reasoning_parser
        self.tool_parser = self.engine.tool_parser()  # the served family's, asked of the plugins once

    def check(self, body: ChatCompletionRequest) -> None:
        if body.functions:
            raise APIError(400, "functions: the legacy function calling is not supported; send tools",
                           "functions", "unsupported")
        if body.function_call not in (None, "none"):
            raise APIError(400, "function_call: the legacy function calling is not supported; send tool_choice",
                           "function_call", "unsupported")
        check_tools_served(self, body.tools)
        choose(body)  # a bad tool_choice is a 400 before anything runs
        if body.top_logprobs not in (None, 0) and not body.logprobs:  # (vLLM's rule: 0 asks for nothing)
            raise APIError(400, "top_logprobs: requires logprobs=true", "top_logprobs")
        if body.prompt_logprobs is not None and body.stream:
            raise APIError(400, "prompt_logprobs: not streamed in a chat; send stream=false", "prompt_logprobs",
                           "unsupported")

    def sampling(self, body: ChatCompletionRequest) -> tuple[dict[str, Any], dict[str, str]]:
        given = body.max_completion_tokens is not None
        kw: dict[str, Any] = {"max_tokens": body.max_completion_tokens if given else body.max_tokens}
        if body.logprobs:
            kw["logprobs"] = body.top_logprobs or 0
        if body.prompt_logprobs is not None:
            kw["prompt_logprobs"] = body.prompt_logprobs
        forced = choose(body)
        if forced is not None:
            if body.response_format is not None and body.response_format.type != "text":
                raise APIError(400, "tool_choice: a required or named tool call is itself the output's format; leave "
                                    "response_format out", "tool_choice")
            many = forced is body.tools and body.parallel_tool_calls is not False
            kw["structured_outputs"] = forced_calls(self.tool_parser, forced, many)
        # response_format and a forced tool call shape the answer, not the thought; vLLM's structured_outputs
        # field constrains the output as written (a grammar may itself spell out the thinking block)
        fmt = body.response_format is not None and body.response_format.type != "text"
        constraint = kw.get("structured_outputs") or (structured_outputs(body) if fmt else None)
        if constraint is not None and self.reasoning_parser is not None:
            parser = self.reasoning_parser
            kw["structured_outputs"] = after_thinking(constraint, parser.START, parser.END)
        return kw, {"max_tokens": "max_completion_tokens" if given else "max_tokens", "logprobs": "top_logprobs"}

    def prompts(self, body: ChatCompletionRequest) -> Prompts:
        prompt = render_chat(self.engine, body.messages, body.chat_template_kwargs,
                             body.tools if body.tool_choice != "none" else None,
                             chat_template=self.serving.chat_template,
                             add_generation_prompt=body.add_generation_prompt,
                             continue_final_message=body.continue_final_message)
        return Prompts([(prompt["prompt"], prompt["prompt_token_ids"])], "messages")

    def response_extra(self, body: ChatCompletionRequest, job: Job) -> dict[str, Any]:
        """vLLM's chat response carries its (one) prompt's logprobs and token ids beside the choices."""
        return {**self.prompt_logprobs(body, job.choices[0]), **self.first_chunk_extra(body, job)}

    def first_chunk_extra(self, body: ChatCompletionRequest, job: Job) -> dict[str, Any]:
        return {"prompt_token_ids": job.prompts[0].ids} if body.return_token_ids else {}

    def role(self, body: ChatCompletionRequest) -> str:
        """The reply's role (vLLM's rule): the server's ``--response-role`` where the prompt asks for a new message,
        else that of the last message, which the reply continues."""
        return self.serving.response_role if body.add_generation_prompt else body.messages[-1].role

    def response_choice(self, body: ChatCompletionRequest, choice: Choice) -> dict[str, Any]:
        logprobs = self.logprobs(choice.token_ids, choice.logprobs, body.top_logprobs or 0,
                                 self.tokens_as_ids(body)) if body.logprobs else None
        message: dict[str, Any] = {"role": self.role(body), "content": choice.text}
        if self.reasoning_parser is not None:
            message["reasoning_content"], message["content"] = split_reasoning(self.reasoning_parser(), choice.text)
        finish = choice.finish_reason
        if offers_tools(body):
            content, calls = split_calls(self.tool_parser, message["content"], body.tools or ())
            message["content"] = content or None
            message["tool_calls"] = [_call_entry(name, args) for name, args in calls]
            finish = _call_finish(body, bool(calls), finish)
        ids = {"token_ids": choice.token_ids} if body.return_token_ids else {}
        return {"index": choice.index, "message": message,
                "logprobs": logprobs, "finish_reason": finish, "stop_reason": choice.stop_reason, **ids}

    def stream(self, body: ChatCompletionRequest) -> _ChatChunks:
        return _ChatChunks(self, body)

    def logprobs(self, token_ids: list[int], entries: list[PositionLogprobs], k: int,
                 as_ids: bool = False) -> dict[str, Any]:
        """OpenAI's chat logprobs: ``{"content": token_entries(...)}``."""
        return {"content": self.token_entries(token_ids, entries, k, as_ids)}


class _ChatChunks:
    """A streamed chat completion: each choice opens with a chunk of the reply's role."""

    def __init__(self, endpoint: ChatEndpoint, body: ChatCompletionRequest) -> None:
        self.endpoint = endpoint
        self.body = body
        self.opened: set[int] = set()
        self.as_ids = endpoint.tokens_as_ids(body)
        self.role = endpoint.role(body)
        parser = endpoint.reasoning_parser
        self.splitters: dict[int, ThinkSplitter] | None = None if parser is None else {}
        self.tools = endpoint.tool_parser if offers_tools(body) else None
        self.calls: dict[int, tuple[CallStream, list[int]]] = {}  # per choice: its stream, calls sent

    def chunks(self, choice: Choice, delta: Delta) -> list[tuple[dict[str, Any], int]]:
        out = []
        if choice.index not in self.opened:
            self.opened.add(choice.index)
            out.append(({"index": choice.index, "delta": {"role": self.role, "content": ""}, "logprobs": None,
                         "finish_reason": None}, 0))
        if not delta.text and not delta.token_ids and delta.finish_reason is None:
            return out
        logprobs = None
        if self.body.logprobs and delta.token_ids:
            logprobs = self.endpoint.logprobs(delta.token_ids, delta.logprobs, self.body.top_logprobs or 0,
                                              self.as_ids)
        content = {"content": delta.text} if delta.text or delta.finish_reason is None else {}
        if self.splitters is not None:
            content = self._split(choice.index, delta.text, delta.finish_reason is not None)
        finish = delta.finish_reason
        ids = {"token_ids": delta.token_ids} if self.body.return_token_ids else {}
        if self.tools is not None:
            content, called = self._tool_calls(choice.index, content, finish is not None)
            finish = _call_finish(self.body, called, finish)
            if not content and finish is None and logprobs is None and not ids:
                return out  # (tokens of a call not complete yet: no chunk, as vLLM sends none)
        out.append(({"index": choice.index, "delta": content, "logprobs": logprobs,
                     "finish_reason": finish, "stop_reason": delta.stop_reason, **ids}, delta.num_tokens))
        return out

    def _tool_calls(self, index: int, delta: dict[str, Any], last: bool) -> tuple[dict[str, Any], bool]:
        """The delta with its content run through the choice's call stream: text outside call blocks stays
        content, each completed call comes as one ``tool_calls`` entry (OpenAI's streamed form, the
        arguments whole); whether this choice has sent a call."""
        stream, sent = self.calls.setdefault(index, (CallStream(self.tools, self.body.tools or ()), []))
        content, calls = stream.feed(delta.get("content", ""))
        if last:
            rest, more = stream.flush()
            content, calls = content + rest, calls + more
        out = {k: v for k, v in delta.items() if k != "content"}
        if content:
            out["content"] = content
        if calls:
            out["tool_calls"] = [{"index": len(sent) + i, **_call_entry(name, args)}
                                 for i, (name, args) in enumerate(calls)]
            sent += [1] * len(calls)
        return out, bool(sent)

    def _split(self, index: int, text: str, last: bool) -> dict[str, str]:
        """A delta's text as its ``reasoning_content`` and ``content`` parts (a part held back as a possible
        tag comes with a later delta, or the last)."""
        splitter = self.splitters.setdefault(index, self.endpoint.reasoning_parser())
        reasoning, content = splitter.feed(text)
        if last:
            r, c = splitter.flush()
            reasoning, content = reasoning + r, content + c
        parts = {k: v for k, v in (("reasoning_content", reasoning), ("content", content)) if v}
        return parts or ({} if last else {"content": ""})


def _call_finish(body: ChatCompletionRequest, called: bool, finish: str | None) -> str | None:
    """The finish reason of a choice that ended on its own (``"stop"``) having called tools, as vLLM and OpenAI
    give it: ``"tool_calls"``, or for a call of the function ``tool_choice`` named, ``"stop"``."""
    return "tool_calls" if called and finish == "stop" and not isinstance(body.tool_choice, dict) else finish


def offers_tools(body: ChatCompletionRequest) -> bool:
    """Whether the model was offered tools (and may call them) in this request."""
    return bool(body.tools) and body.tool_choice != "none"


def choose(body: ChatCompletionRequest) -> list[dict[str, Any]] | None:
    """The tools ``tool_choice`` forces a call of (see ``forced_tools``)."""
    choice = body.tool_choice
    if isinstance(choice, dict):  # (the request's model checked the shapes: ``protocol.Tool``)
        return forced_tools(choice, choice["function"]["name"], body.tools or [])
    return forced_tools(choice, None, body.tools or [])


def forced_tools(choice: Any, name: str | None, tools: list[dict[str, Any]]) -> list[dict[str, Any]] | None:
    """The tools (chat's form) a ``tool_choice`` forces a call of: ``"required"``, every offered tool; a named
    function (``name``), that one; None for ``"auto"``, ``"none"`` or unset. A choice no tool answers is a 400
    naming it (``choice`` as the request wrote it)."""
    if choice in (None, "auto", "none"):
        return None
    if not tools:
        raise APIError(400, f"tool_choice={choice!r}: requires tools", "tool_choice")
    if choice == "required":
        return tools
    named = [t for t in tools if t["function"]["name"] == name]
    if not named:
        raise APIError(400, f"tool_choice: the function {name!r} is not among the tools "
                            f"{[t['function']['name'] for t in tools]}", "tool_choice")
    return named


def check_tools_served(endpoint: ChatEndpoint | Any, tools: Any) -> None:
    """Tools offered to a family with no tool-call parser (the endpoint's ``tool_parser``) are a 400 saying so."""
    if tools and endpoint.tool_parser is None:
        raise APIError(400, f"tools: the served model's family {endpoint.engine.engine.family.name!r} has no tool-call "
                            "parser (a plugin supplies one through vtcore_tool_parser)", "tools", "unsupported")


def _call_entry(name: str, arguments: str) -> dict[str, Any]:
    return {"id": call_id(), "type": "function", "function": {"name": name, "arguments": arguments}}

