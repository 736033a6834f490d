"""``POST /v1/completions``: text or token-id prompts (a batch is a choice each, times ``n``),
``echo`` (the prompt, with its logprobs when asked for, before the text), OpenAI's logprobs form, and
vLLM's ``prompt_logprobs`` (in a streamed choice's first chunk, as ``echo`` waits for them)."""
from __future__ import annotations

from typing import Any

from vtcore.outputs import PositionLogprobs
from vtcore.server.errors import APIError
from vtcore.server.generation import Choice, Delta, GenerationEndpoint, Prompts, cut_logprobs, finite
from vtcore.server.protocol import CompletionRequest

#: (token, its logprobs) a position; a prompt's first position has none
Entries = list[tuple[int, PositionLogprobs | None]]


class CompletionsEndpoint(GenerationEndpoint[CompletionRequest]):
    id_prefix = "cmpl"
    object = "text_completion"
    chunk_object = "text_completion"

    def check(self, body: CompletionRequest) -> None:
        if body.suffix:
            raise APIError(400, "suffix: insertion (a non-empty suffix) is not supported", "suffix", "unsupported")

    def light(self, body: CompletionRequest) -> bool:
        prompt = body.prompt  # token ids, one prompt or a batch, without an echo (which decodes them)
        return not body.echo and not isinstance(prompt, str) and not isinstance(prompt[0], str)

    def sampling(self, body: CompletionRequest) -> tuple[dict[str, Any], dict[str, str]]:
        kw: dict[str, Any] = {"max_tokens": body.max_tokens}
        if body.logprobs is not None:
            kw["logprobs"] = body.logprobs
        wanted = [k for k in (body.logprobs if body.echo else None, body.prompt_logprobs) if k is not None]
        if wanted:  # the engine computes the more of the two (-1: the whole vocabulary); each is cut to its own
            kw["prompt_logprobs"] = -1 if -1 in wanted else max(wanted)
        return kw, {"prompt_logprobs": "prompt_logprobs" if body.prompt_logprobs is not None else "logprobs"}

    def prompts(self, body: CompletionRequest) -> Prompts:
        prompt = body.prompt
        batch = [prompt] if isinstance(prompt, str) or isinstance(prompt[0], int) else prompt
        items = []
        for p in batch:
            if isinstance(p, str):
                try:
                    text, ids = self.engine.tokenize(p, body.add_special_tokens)
                except ValueError as exc:
                    raise APIError(400, f"prompt: {exc}", "prompt") from None
            else:  # ids the request model has checked: ints in the vocabulary's range
                text, ids = None, p
            if text is None and body.echo:  # ids alone: their text only for the echo (decoding costs the GIL)
                text = self.serving.decode(ids)
            items.append((text, ids))
        return Prompts(items, "prompt", batched=batch is prompt)

    def response_choice(self, body: CompletionRequest, choice: Choice) -> dict[str, Any]:
        text = choice.text
        entries: Entries = [(t, choice.logprobs[i] if i < len(choice.logprobs) else None)
                            for i, t in enumerate(choice.token_ids)]
        if body.echo:
            text = choice.prompt.text + text
            entries = cut_logprobs(choice.prompt_entries(), body.logprobs) + entries
        logprobs = None if body.logprobs is None else self.logprobs(entries, 0, self.tokens_as_ids(body))[0]
        ids = {"prompt_token_ids": choice.prompt.ids, "token_ids": choice.token_ids} if body.return_token_ids else {}
        return {"index": choice.index, "text": text, "logprobs": logprobs, "finish_reason": choice.finish_reason,
                "stop_reason": choice.stop_reason, **self.prompt_logprobs(body, choice), **ids}

    def stream(self, body: CompletionRequest) -> _CompletionChunks:
        return _CompletionChunks(self, body)

    def logprobs(self, entries: Entries, offset: int, as_ids: bool = False) -> tuple[dict[str, Any], int]:
        """OpenAI's completions logprobs of ``entries`` whose text starts at character ``offset``,
        and the offset after them; ``as_ids``: tokens named ``token_id:{id}`` (offsets still count text)."""
        tokens, token_lps, tops, offsets = [], [], [], []
        for tid, pos in entries:
            chosen = pos.get(tid) if pos else None
            tokens.append(self.label(tid, chosen, as_ids))
            token_lps.append(None if chosen is None else finite(chosen.logprob))
            tops.append(None if pos is None else {self.label(t, lp, as_ids): finite(lp.logprob)
                                                  for t, lp in pos.items()})
            offsets.append(offset)
            offset += len(self.piece(tid, chosen))
        return {"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": tops, "text_offset": offsets}, offset


class _CompletionChunks:
    """A streamed completion: a choice's echo waits for all of its prompt's logprobs (prefill may
    come in chunks); logprobs' text offsets run on across chunks."""

    def __init__(self, endpoint: CompletionsEndpoint, body: CompletionRequest) -> None:
        self.endpoint = endpoint
        self.body = body
        self.echoed: set[int] = set()
        self.offsets: dict[int, int] = {}
        self.as_ids = endpoint.tokens_as_ids(body)
        self.ids_sent: set[int] = set()  # choices whose prompt ids went out (return_token_ids)

    def chunks(self, choice: Choice, delta: Delta) -> list[tuple[dict[str, Any], int]]:
        text = delta.text
        entries: Entries = list(zip(delta.token_ids, delta.logprobs or [None] * len(delta.token_ids)))
        extra: dict[str, Any] = {}
        if (self.body.echo or self.body.prompt_logprobs is not None) and choice.index not in self.echoed:
            if not choice.prompt_logprobs_ready:
                return []
            self.echoed.add(choice.index)
            extra = self.endpoint.prompt_logprobs(self.body, choice)
            if self.body.echo:
                text = choice.prompt.text + text
                entries = cut_logprobs(choice.prompt_entries(), self.body.logprobs) + entries
        if not text and not entries and not extra and delta.finish_reason is None:
            return []
        logprobs = None
        if self.body.logprobs is not None:
            logprobs, self.offsets[choice.index] = self.endpoint.logprobs(entries, self.offsets.get(choice.index, 0),
                                                                          self.as_ids)
        if self.body.return_token_ids:
            if choice.index not in self.ids_sent:
                self.ids_sent.add(choice.index)
                extra["prompt_token_ids"] = choice.prompt.ids
            extra["token_ids"] = delta.token_ids
        return [({"index": choice.index, "text": text, "logprobs": logprobs, "finish_reason": delta.finish_reason,
                  "stop_reason": delta.stop_reason, **extra}, delta.num_tokens)]
