"""Incremental detokenization: text grows token by token, split UTF-8 characters held back, stop strings cut.

Each token's new text is what decoding the recent tokens with it adds to decoding them without it (a
prefix and a read offset; an incomplete UTF-8 sequence waits for the next token). A fast (Rust)
tokenizer that does no clean-up of spaces runs that algorithm in Rust (``tokenizers``'
``DecodeStream``, about 2 us a token against about 25 through two ``decode`` calls): the engine thread
detokenizes every running request each step.
"""
from __future__ import annotations

from typing import Any

#: Prompt tokens decoded in front of the output so that word-boundary rules see real context.
CONTEXT_TOKENS = 5


class IncrementalDetokenizer:
    """The output text of one request; ``add`` returns the stop string that ended it, if any."""

    def __init__(self, tokenizer: Any, prompt_ids: list[int], skip_special_tokens: bool, stop: list[str],
                 include_stop_str_in_output: bool) -> None:
        self.tokenizer = tokenizer
        self.skip = skip_special_tokens
        self.ids = list(prompt_ids[-CONTEXT_TOKENS:])
        self._backend, self._stream = _decode_stream(tokenizer, self.ids, skip_special_tokens)
        self.prefix_offset = 0
        self.read_offset = len(self.ids)
        self.text = ""
        self.stop = stop
        self.include_stop = include_stop_str_in_output
        # While running, this many trailing characters may still turn out to start a stop string.
        self.holdback = max((len(s) for s in stop), default=1) - 1

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip)

    def add(self, token_id: int, check_stop: bool = True) -> str | None:
        """Append a token's text; return the stop string that ends the output, if one now appears.

        Of the stop strings in the new text, the one that ends first wins (of those ending at one
        character, the longest): the text stops where it would have, had it come a character at a
        time, whatever the tokens' boundaries. The text is cut before it (after it with
        ``include_stop_str_in_output``): no stop string ends in what is left before it.
        """
        self.ids.append(token_id)
        if self._stream is not None:
            new = self._stream.step(self._backend, token_id)
            if not new:
                return None  # an incomplete UTF-8 sequence: wait for the next token
        else:
            prefix = self._decode(self.ids[self.prefix_offset:self.read_offset])
            full = self._decode(self.ids[self.prefix_offset:])
            if len(full) <= len(prefix) or full.endswith("\ufffd"):
                return None
            new = full[len(prefix):]
        before = len(self.text)
        self.text += new
        self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
        if not check_stop:
            return None
        found = [(at + len(stop), at, stop) for stop in self.stop
                 if (at := self.text.find(stop, max(0, before - len(stop) + 1))) >= 0]
        if not found:
            return None
        end, at, stop = min(found, key=lambda f: f[:2])
        self.text = self.text[:end] if self.include_stop else self.text[:at]
        return stop

    def flush(self) -> None:
        """At the end, take whatever is pending, an incomplete character included."""
        prefix = self._decode(self.ids[self.prefix_offset:self.read_offset])
        full = self._decode(self.ids[self.prefix_offset:])
        if len(full) > len(prefix):
            self.text += full[len(prefix):]
        self.prefix_offset = self.read_offset = len(self.ids)

    def output_text(self, finished: bool, stop_reason: Any) -> str:
        """The text an output shows: at the end (unless a stop string or token ended it) with whatever is
        pending flushed; while running, ``visible_text``."""
        if finished and stop_reason is None:
            self.flush()
        return self.visible_text(finished)

    def visible_text(self, finished: bool) -> str:
        """The text safe to show: while running, the tail that may begin a stop string is held back."""
        if finished or not self.holdback:
            return self.text
        return self.text[:max(0, len(self.text) - self.holdback)]


def _decode_stream(tokenizer: Any, context: list[int], skip_special_tokens: bool) -> tuple[Any, Any]:
    """(the Rust tokenizer, a ``DecodeStream`` primed with ``context``) for a fast tokenizer that cleans
    up no spaces; (None, None) otherwise (the two-``decode`` path)."""
    try:
        from tokenizers import Tokenizer
        from tokenizers.decoders import DecodeStream
    except ImportError:  # tokenizers before 0.21
        return None, None
    backend = getattr(tokenizer, "_tokenizer", None)
    if not isinstance(backend, Tokenizer) or getattr(tokenizer, "clean_up_tokenization_spaces", False):
        return None, None
    try:
        return backend, DecodeStream(context, skip_special_tokens=skip_special_tokens)
    except TypeError:  # tokenizers before 0.22 take no context
        return None, None
