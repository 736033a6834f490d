"""Grammars compiled with xgrammar, one compile per distinct constraint, and a request's matcher.

The engine's host fills each constrained sampling row's token bitmask from the request's matcher
(the tokens the host has applied so far), the sampler applies it on the device before any other
logit edit, and each applied token advances the matcher; a matcher that has terminated (the
grammar is complete and accepted a stop token) ends its request. A row's mask exists once the
matcher stands at the row's output position (every earlier token accepted): under async
scheduling the row is drawn late, once its request's in-flight token has landed
(``vtcore.worker.sampler``).
"""
from __future__ import annotations

import json
import re
import threading
from typing import Any, Callable, Sequence

import torch

from vtcore.structured.params import StructuredOutputsParams


class GrammarCache:
    """Compiles constraints for one tokenizer and model vocabulary (logits width); thread-safe.

    The matchers' vocabulary is the tokenizer's own ``tokens`` (its bitmasks ``words`` 32-token words
    wide), not a model vocabulary padded past them: xgrammar takes padding ids for special tokens and
    scans them on every accepted token, which costs a constrained row tens of microseconds a step at a
    padding of 150k ids (docs/BENCHMARKS.md); ``vtcore.kernels.bitmask.unpack_bitmask`` disallows the padding
    ids instead."""

    def __init__(self, tokenizer: Any, vocab_size: int, stop_token_ids: Sequence[int]) -> None:
        import xgrammar as xgr

        self._xgr = xgr
        # (ids may leave gaps: the highest one counts, as xgrammar counts it)
        self.tokens = min(vocab_size, max(len(tokenizer), max(tokenizer.get_vocab().values(), default=-1) + 1))
        self.words = -(-self.tokens // 32)
        stops = [t for t in stop_token_ids if t < self.tokens] or None  # (None: xgrammar finds the tokenizer's)
        self.info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=self.tokens, stop_token_ids=stops)
        self.compiler = xgr.GrammarCompiler(self.info)
        self._compiled: dict[tuple[str, str], Any] = {}
        self._compiling: dict[tuple[str, str], threading.Lock] = {}
        self._lock = threading.Lock()

    def compile(self, params: StructuredOutputsParams) -> Any:
        """The compiled grammar of ``params`` (cached; requests that ask for one being compiled wait for
        that compile); a constraint xgrammar refuses raises ``ValueError`` naming the field and xgrammar's
        reason."""
        key = params.key()
        with self._lock:
            if key in self._compiled:
                return self._compiled[key]
            one = self._compiling.setdefault(key, threading.Lock())
        with one:
            with self._lock:
                if key in self._compiled:
                    return self._compiled[key]
            parsed = grammar_of(params)  # (refuses by itself, naming the field)
            grammar = refused_as_value_error(f"structured_outputs.{key[0]}",
                                             lambda: self.compiler.compile_grammar(parsed))
            with self._lock:
                self._compiled[key] = grammar
                self._compiling.pop(key, None)
        return grammar

    def compiled(self, params: StructuredOutputsParams) -> bool:
        """Whether ``params`` is compiled already (a request for it needs no compile off the engine thread)."""
        with self._lock:
            return params.key() in self._compiled

    def matcher(self, params: StructuredOutputsParams) -> "RequestGrammar":
        return RequestGrammar(self._xgr.GrammarMatcher(self.compile(params)), self)


class RequestGrammar:
    """A request's place in its grammar: the tokens it accepted, whether that ended it (kept here: only an
    accepted token changes it, and the sampler asks for every row of every step), and the output positions
    whose masked draw is on the device (``masked``: the next position that has none)."""

    def __init__(self, matcher: Any, cache: GrammarCache) -> None:
        self.matcher, self.cache = matcher, cache
        self.accepted = 0
        self.masked = 0
        self.terminated = bool(matcher.is_terminated())

    def stands_at(self, position: int) -> bool:
        """Whether the mask of output ``position`` can be filled now: every earlier token accepted."""
        return self.accepted == position and not self.terminated

    def accept(self, token: int) -> bool:
        """Advance past ``token``; False when the grammar does not allow it."""
        ok = bool(self.matcher.accept_token(token))
        if ok:
            self.accepted += 1
            self.terminated = bool(self.matcher.is_terminated())
        return ok


def fill_bitmasks(rows: Sequence[tuple[RequestGrammar, int]], out: torch.Tensor) -> torch.Tensor:
    """Fill ``out`` (int32 [>= len(rows), the grammars' ``GrammarCache.words``], host memory) with the masks
    of ``(grammar, output position)`` rows whose grammars stand at their positions, 32 tokens a word; each
    position is then ``masked``. Returns the filled rows of ``out``."""
    for i, (grammar, position) in enumerate(rows):
        grammar.matcher.fill_next_token_bitmask(out, i)
        grammar.masked = position + 1
    return out[:len(rows)]


def grammar_of(params: StructuredOutputsParams) -> Any:
    """The xgrammar ``Grammar`` (not yet compiled) of a constraint; one xgrammar refuses raises
    ``ValueError`` naming the field and xgrammar's reason."""
    import xgrammar as xgr

    kind, value, one_layout = params.key()

    def build() -> Any:
        if kind == "json":
            return xgr.Grammar.from_json_schema(value, any_whitespace=not one_layout)
        if kind == "json_object":  # a JSON object (OpenAI's JSON mode), not any JSON value
            return xgr.Grammar.from_json_schema('{"type": "object"}', any_whitespace=not one_layout)
        if kind == "regex":
            return xgr.Grammar.from_regex(value)
        if kind == "choice":
            return xgr.Grammar.from_regex("|".join(_regex_literal(s) for s in json.loads(value)))
        return xgr.Grammar.from_ebnf(value)

    return refused_as_value_error(f"structured_outputs.{kind}", build)


def after_thinking(params: StructuredOutputsParams, start: str, end: str) -> StructuredOutputsParams:
    """``params`` applied to the answer only: an optional thinking block (``start``, text without ``end``,
    ``end``, newlines) before it, for a server that splits reasoning from the answer."""
    import re

    import xgrammar as xgr

    # text in which ``end`` never occurs: any character but its first, or a proper prefix of it cut short
    first = re.escape(end[0])
    cut = [re.escape(end[:i]) + "[^" + re.escape(end[i]) + "]" for i in range(1, len(end))]
    body = "(" + "|".join([f"[^{first}]", *cut]) + ")*"
    think = xgr.Grammar.from_regex(re.escape(start) + body + re.escape(end) + "\n*")
    optional = xgr.Grammar.union(think, xgr.Grammar.from_ebnf('root ::= ""'))
    return StructuredOutputsParams(grammar=str(xgr.Grammar.concat(optional, grammar_of(params))))


class GrammarRefused(ValueError):
    """A constraint xgrammar cannot build or compile, naming the field as the caller did, with xgrammar's
    ``reason``."""

    def __init__(self, field: str, reason: str) -> None:
        super().__init__(f"{field}: xgrammar cannot compile it: {reason}")
        self.reason = reason


#: the C++ log prefix of xgrammar's errors: "[05:35:06] /project/cpp/json_schema_converter.cc:5082: "
_LOG_PREFIX = re.compile(r"^\[[\d:]+\] \S+?:\d+: ")


def refused_as_value_error(field: str, build: Callable[[], Any]) -> Any:
    """``build()``; what xgrammar raises for a bad constraint is a ``GrammarRefused`` naming ``field``, with
    xgrammar's own reason (its log prefix dropped)."""
    try:
        return build()
    except Exception as exc:  # noqa: BLE001 - xgrammar raises RuntimeError / its own types for a bad input
        raise GrammarRefused(field, _LOG_PREFIX.sub("", str(exc)).strip()) from None


def _regex_literal(text: str) -> str:
    """``text`` as a regular expression matching exactly it."""
    return "".join("\\" + ch if ch in r"\.^$|?*+()[]{}/" else ch for ch in text)
