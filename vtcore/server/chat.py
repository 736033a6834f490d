"""``POST /v1/chat/completions``: a conversation through the chat template (``render_chat``, which
``/tokenize`` shares), text content only, no tools; OpenAI's chat logprobs form; with a reasoning
parser (:mod:`vtcore.server.reasoning`) the thinking block as ``reasoning_content``."""
from __future__ import annotations

from typing import Any

from vtcore.engine.front_end import EngineFrontEnd
from vtcore.outputs import PositionLogprobs
from vtcore.server.errors import APIError
from vtcore.server.generation import NO_LOGPROB, Choice, Delta, GenerationEndpoint, Prompts, finite
from vtcore.server.protocol import UNSUPPORTED_EXTENSIONS, ChatCompletionRequest, ChatMessage
from vtcore.server.reasoning import ThinkSplitter, split_reasoning
from vtcore.server.serving import Serving

#: apply_chat_template's own arguments: a request may not set them through chat_template_kwargs (a
#: custom template would get round the refusal of the top-level field)
_RESERVED_TEMPLATE_KWARGS = {"chat_template", "conversation", "tokenize", "add_generation_prompt",
                             "continue_final_message", "tools", "documents", "return_dict", "tokenizer_kwargs"}


def render_chat(engine: EngineFrontEnd, messages: list[ChatMessage],
                template_kwargs: dict[str, Any] | None) -> dict[str, Any]:
    """``{"prompt": text, "prompt_token_ids": ids}`` of a conversation through the chat template
    (text parts joined by newlines); what is wrong with it is an APIError naming the field."""
    conversation = []
    for i, m in enumerate(messages):
        content = m.content
        if isinstance(content, list):
            parts = []
            for part in content:
                if part.type != "text" or part.text is None:
                    raise APIError(400, f"messages[{i}].content: part of type {part.type!r}; only text parts "
                                        "are supported", "messages", "unsupported")
                parts.append(part.text)
            content = "\n".join(parts)
        msg = {"role": m.role, "content": content}
        if m.name is not None:
            msg["name"] = m.name
        conversation.append(msg)
    reserved = sorted(set(template_kwargs or {}) & _RESERVED_TEMPLATE_KWARGS)
    if reserved:
        raise APIError(400, f"chat_template_kwargs: {reserved[0]!r} is not a template variable the server lets a "
                            "request set", "chat_template_kwargs", "unsupported")
    try:
        return engine.chat_prompt(conversation, **(template_kwargs or {}))
    except Exception as exc:  # noqa: BLE001 - the template rejected the conversation
        raise APIError(400, f"messages: the chat template failed: {type(exc).__name__}: {exc}", "messages") from None


class ChatEndpoint(GenerationEndpoint[ChatCompletionRequest]):
    id_prefix = "chatcmpl"
    object = "chat.completion"
    chunk_object = "chat.completion.chunk"
    refused_extensions = {**UNSUPPORTED_EXTENSIONS, "echo": False}

    def __init__(self, serving: Serving, reasoning_parser: type[ThinkSplitter] | None = None) -> None:
        super().__init__(serving)
        self.reasoning_parser = reasoning_parser

    def check(self, body: ChatCompletionRequest) -> None:
        for field in ("tools", "functions"):
            if getattr(body, field):
                raise APIError(400, f"{field}: tool and function calling are not supported", field, "unsupported")
        for field in ("tool_choice", "function_call"):
            if getattr(body, field) not in (None, "none"):
                raise APIError(400, f"{field}: tool and function calling are not supported", field, "unsupported")
        if body.top_logprobs is not None and not body.logprobs:
            raise APIError(400, "top_logprobs: requires logprobs=true", "top_logprobs")

    def sampling(self, body: ChatCompletionRequest) -> tuple[dict[str, Any], dict[str, str]]:
        given = body.max_completion_tokens is not None
        kw: dict[str, Any] = {"max_tokens": body.max_completion_tokens if given else body.max_tokens}
        if body.logprobs:
            kw["logprobs"] = body.top_logprobs or 0
        return kw, {"max_tokens": "max_completion_tokens" if given else "max_tokens", "logprobs": "top_logprobs"}

    def prompts(self, body: ChatCompletionRequest) -> Prompts:
        prompt = render_chat(self.engine, body.messages, body.chat_template_kwargs)
        return Prompts([(prompt["prompt"], prompt["prompt_token_ids"])], "messages")

    def response_choice(self, body: ChatCompletionRequest, choice: Choice) -> dict[str, Any]:
        logprobs = self.logprobs(choice.token_ids, choice.logprobs, body.top_logprobs or 0) if body.logprobs else None
        message: dict[str, Any] = {"role": "assistant", "content": choice.text}
        if self.reasoning_parser is not None:
            message["reasoning_content"], message["content"] = split_reasoning(self.reasoning_parser(), choice.text)
        return {"index": choice.index, "message": message,
                "logprobs": logprobs, "finish_reason": choice.finish_reason, "stop_reason": choice.stop_reason}

    def stream(self, body: ChatCompletionRequest) -> _ChatChunks:
        return _ChatChunks(self, body)

    def logprobs(self, token_ids: list[int], entries: list[PositionLogprobs], k: int) -> dict[str, Any]:
        """OpenAI's chat logprobs: each token with its ``k`` most likely alternatives."""
        content = []
        for tid, pos in zip(token_ids, entries):
            chosen = pos.get(tid)
            tok = self.piece(tid, chosen)
            top = sorted((lp.rank, t, lp) for t, lp in pos.items() if lp.rank is not None and lp.rank <= k)[:k]
            content.append({"token": tok, "logprob": finite(chosen.logprob) if chosen else NO_LOGPROB,
                            "bytes": list(tok.encode()),
                            "top_logprobs": [{"token": self.piece(t, lp), "logprob": finite(lp.logprob),
                                              "bytes": list(self.piece(t, lp).encode())} for _, t, lp in top]})
        return {"content": content}


class _ChatChunks:
    """A streamed chat completion: each choice opens with a chunk of the assistant role."""

    def __init__(self, endpoint: ChatEndpoint, body: ChatCompletionRequest) -> None:
        self.endpoint = endpoint
        self.body = body
        self.opened: set[int] = set()
        parser = endpoint.reasoning_parser
        self.splitters: dict[int, ThinkSplitter] | None = None if parser is None else {}

    def chunks(self, choice: Choice, delta: Delta) -> list[tuple[dict[str, Any], int]]:
        out = []
        if choice.index not in self.opened:
            self.opened.add(choice.index)
            out.append(({"index": choice.index, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                         "finish_reason": None}, 0))
        if not delta.text and not delta.token_ids and delta.finish_reason is None:
            return out
        logprobs = None
        if self.body.logprobs and delta.token_ids:
            logprobs = self.endpoint.logprobs(delta.token_ids, delta.logprobs, self.body.top_logprobs or 0)
        content = {"content": delta.text} if delta.text or delta.finish_reason is None else {}
        if self.splitters is not None:
            content = self._split(choice.index, delta.text, delta.finish_reason is not None)
        out.append(({"index": choice.index, "delta": content, "logprobs": logprobs,
                     "finish_reason": delta.finish_reason, "stop_reason": delta.stop_reason}, delta.num_tokens))
        return out

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
