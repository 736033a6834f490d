"""SamplingParams: how one request is sampled and when it stops (vLLM's fields and defaults)."""
from __future__ import annotations

import enum
import math
import numbers
from collections.abc import Callable, Iterable
from typing import Any

import attrs

from vtcore.errors import NotSupportedError
from vtcore.structured.params import StructuredOutputsParams

#: vLLM's older name of ``StructuredOutputsParams`` (``SamplingParams(guided_decoding=...)`` takes it too)
GuidedDecodingParams = StructuredOutputsParams


class RequestOutputKind(enum.Enum):
    """What each streamed ``RequestOutput`` carries."""

    CUMULATIVE = 0  # everything generated so far
    DELTA = 1  # only what is new since the last output
    FINAL_ONLY = 2  # nothing until the request finishes


#: temperatures below this sample greedily (vLLM's threshold): dividing logits by less overflows float32
GREEDY_TEMPERATURE = 1e-5
_SEED_RANGE = (-2 ** 63, 2 ** 64)  # what torch.Generator.manual_seed takes
#: the white space a bad word must hold more than (ASCII's: one set in Python, JSON Schema and pydantic patterns)
ASCII_SPACE = " \t\n\r\x0b\x0c"


#: the integer fields: an integer of another type (a numpy integer; not a bool) is taken as its int, as vLLM's
#: comparisons take it
_INT_FIELDS = ("n", "best_of", "top_k", "max_tokens", "min_tokens", "seed", "logprobs", "prompt_logprobs",
               "truncate_prompt_tokens")


def as_int(value: Any) -> Any:
    """``value`` as a Python int where it is an integer of another type (a numpy integer; not a bool), else as is."""
    if type(value) is not int and isinstance(value, numbers.Integral) and not isinstance(value, bool):
        return int(value)
    return value


def _bad(name: str, value: Any, expected: str) -> ValueError:
    return ValueError(f"SamplingParams.{name}={value!r}: expected {expected}")


@attrs.define(kw_only=True)
class SamplingParams:
    """Sampling and stopping for one request. A bad value raises ``ValueError`` naming it."""

    n: int = 1
    best_of: int | None = None
    use_beam_search: bool = False
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] | None = None
    allowed_token_ids: list[int] | None = None  # only these may be sampled (vLLM's)
    bad_words: list[str] | None = None  # never generated: a word's last token is banned after the rest (vLLM's)
    truncate_prompt_tokens: int | None = None  # keep the prompt's last k tokens; -1: max_model_len (vLLM's)
    seed: int | None = None  # -1: None (vLLM's)
    max_tokens: int | None = 16
    min_tokens: int = 0
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    logprobs: int | None = None  # -1: the whole vocabulary (vLLM's)
    prompt_logprobs: int | None = None  # -1: the whole vocabulary
    skip_special_tokens: bool = True
    detokenize: bool = True  # False: no text (token ids only; no stop strings)
    extra_args: dict[str, Any] | None = None  # vLLM's: for a custom sampler or logits processor; vtcore reads none
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
    structured_outputs: StructuredOutputsParams | None = None
    guided_decoding: StructuredOutputsParams | None = None  # vLLM's older name: moved into structured_outputs
    spaces_between_special_tokens: bool = True  # vLLM's; without effect on the fast tokenizers used here (as vLLM's)
    logits_processors: list[Any] | None = None  # vLLM V1's rule: none per request (set, it is refused by name)

    def __attrs_post_init__(self) -> None:
        if self.guided_decoding is not None:
            if self.structured_outputs is not None:
                raise _bad("guided_decoding", self.guided_decoding, "None beside structured_outputs (its newer name): "
                                                                    "send one")
            self.structured_outputs, self.guided_decoding = self.guided_decoding, None
        if not isinstance(self.spaces_between_special_tokens, bool):
            raise _bad("spaces_between_special_tokens", self.spaces_between_special_tokens, "a bool")
        if self.logits_processors:
            raise _bad("logits_processors", self.logits_processors, "None: per-request logits processors are not "
                                                                    "supported (as in vLLM V1)")
        for name in _INT_FIELDS:
            setattr(self, name, as_int(getattr(self, name)))
        for name in ("logprobs", "prompt_logprobs"):  # (vLLM's: True asks for one alternative, False for none)
            if isinstance(getattr(self, name), bool):
                setattr(self, name, int(getattr(self, name)))
        if isinstance(self.structured_outputs, dict):
            self.structured_outputs = StructuredOutputsParams(**self.structured_outputs)
        if self.structured_outputs is not None and not isinstance(self.structured_outputs, StructuredOutputsParams):
            raise _bad("structured_outputs", self.structured_outputs, "a StructuredOutputsParams (or its fields as a dict)")
        if not _is_int(self.n) or self.n < 1:
            raise _bad("n", self.n, "a positive integer (samples of the prompt)")
        if self.best_of not in (None, 1):
            raise NotSupportedError(f"SamplingParams.best_of={self.best_of!r}: only None or 1 is supported (the n "
                                    "samples are all returned)")
        if self.use_beam_search:
            raise NotSupportedError("SamplingParams.use_beam_search=True: beam search is not supported")
        self._check_number("temperature", self.temperature, 0.0, None, "a number >= 0")
        if self.n > 1 and self.greedy:  # (vLLM's rule: n greedy samples would be n copies of one)
            raise _bad("n", self.n, f"1 with greedy sampling (temperature={self.temperature!r}); n > 1 samples at a "
                                    "temperature above 0")
        self._check_number("top_p", self.top_p, 0.0, 1.0, "a number in (0, 1]", open_low=True)
        self._check_number("min_p", self.min_p, 0.0, 1.0, "a number in [0, 1]")
        self._check_number("presence_penalty", self.presence_penalty, -2.0, 2.0, "a number in [-2, 2]")
        self._check_number("frequency_penalty", self.frequency_penalty, -2.0, 2.0, "a number in [-2, 2]")
        self._check_number("repetition_penalty", self.repetition_penalty, 0.0, None, "a number > 0", open_low=True)
        if not _is_int(self.top_k) or self.top_k < -1:
            raise _bad("top_k", self.top_k, "an integer >= 1, or 0 / -1 for no top-k")
        if self.top_k == -1:
            self.top_k = 0
        if self.max_tokens is not None and (not _is_int(self.max_tokens) or self.max_tokens < 0):
            raise _bad("max_tokens", self.max_tokens, "an integer >= 0, or None for up to the context length")
        if not _is_int(self.min_tokens) or self.min_tokens < 0 or (
                self.max_tokens is not None and self.min_tokens > self.max_tokens):
            raise _bad("min_tokens", self.min_tokens, f"an integer in [0, max_tokens={self.max_tokens}]")
        if self.seed == -1 and _is_int(self.seed):
            self.seed = None
        if self.seed is not None and not (_is_int(self.seed) and _SEED_RANGE[0] <= self.seed < _SEED_RANGE[1]):
            raise _bad("seed", self.seed, "an integer in [-2**63, 2**64) or None")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and (not _is_int(value) or value < -1):
                raise _bad(name, value, "an integer >= 0 (how many top alternatives to return), -1 (the whole "
                                        "vocabulary) or None")
        for name in ("skip_special_tokens", "detokenize", "include_stop_str_in_output", "ignore_eos"):
            if not isinstance(getattr(self, name), bool):
                raise _bad(name, getattr(self, name), "True or False")
        if self.extra_args is not None:
            if not isinstance(self.extra_args, dict):
                raise _bad("extra_args", self.extra_args, "a dict or None")
            self.extra_args = dict(self.extra_args)
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = _listed("stop", self.stop, "a non-empty string or a list of them",
                            lambda s: isinstance(s, str) and s)
        if self.stop and not self.detokenize:
            raise _bad("stop", self.stop, "no stop strings with detokenize=False (they match text; stop_token_ids "
                                          "match ids)")
        self.stop_token_ids = list(dict.fromkeys(_listed("stop_token_ids", self.stop_token_ids,
                                                         "a list of token ids >= 0", _is_id)))
        if self.logit_bias is not None:
            try:
                self.logit_bias = {int(k): float(v) for k, v in self.logit_bias.items()}
            except (TypeError, ValueError, AttributeError):
                raise _bad("logit_bias", self.logit_bias, "a dict of token id -> bias") from None
            bad = {k: v for k, v in self.logit_bias.items() if v != v or v == float("inf")}
            if bad:
                raise _bad("logit_bias", bad, "biases that are numbers < inf (-inf bans a token)")
        if self.allowed_token_ids is not None:
            self.allowed_token_ids = _listed("allowed_token_ids", self.allowed_token_ids,
                                             "a non-empty list of token ids >= 0", _is_id, non_empty=True)
        if self.bad_words is not None:
            self.bad_words = _listed("bad_words", [self.bad_words] if isinstance(self.bad_words, str) else
                                     self.bad_words, "a list of words (strings with more than white space)",
                                     lambda w: isinstance(w, str) and w.strip(ASCII_SPACE))
        if self.truncate_prompt_tokens is not None and not (
                _is_int(self.truncate_prompt_tokens) and (self.truncate_prompt_tokens >= 1
                                                          or self.truncate_prompt_tokens == -1)):
            raise _bad("truncate_prompt_tokens", self.truncate_prompt_tokens,
                       "an integer >= 1 (keep the prompt's last k tokens), -1 (the model's context length) or None")
        if not isinstance(self.output_kind, RequestOutputKind):
            raise _bad("output_kind", self.output_kind, "a RequestOutputKind")

    def _check_number(self, name: str, value: Any, low: float, high: float | None, expected: str,
                      open_low: bool = False) -> None:
        if isinstance(value, bool) or not isinstance(value, numbers.Real) or not _finite(value):
            raise _bad(name, value, expected)
        if value < low or (open_low and value == low) or (high is not None and value > high):
            raise _bad(name, value, expected)
        setattr(self, name, float(value))

    def clone(self) -> "SamplingParams":
        """A copy (vLLM's API); its lists and dicts are its own."""
        return attrs.evolve(self)

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE

    @property
    def penalised(self) -> bool:
        """Whether a repetition, presence or frequency penalty edits this request's logits."""
        return self.repetition_penalty != 1.0 or bool(self.presence_penalty) or bool(self.frequency_penalty)

    def sample(self, index: int) -> "SamplingParams":
        """Sample ``index`` of an ``n > 1`` request as a request of its own (vLLM's parallel sampling):
        ``n=1``, seeded ``seed + index`` (wrapped into ``torch.Generator.manual_seed``'s range) when seeded."""
        if not _is_int(index) or index < 0:
            raise ValueError(f"SamplingParams.sample(index={index!r}): expected an integer >= 0")
        seed = None if self.seed is None else self.seed + index
        if seed is not None and seed >= _SEED_RANGE[1]:
            seed -= _SEED_RANGE[1]
        return attrs.evolve(self, n=1, seed=seed)

    def check_vocab(self, vocab_size: int, max_logprobs: int = -1) -> None:
        """Reject token ids that the model's vocabulary does not hold, and more alternatives than it has or than
        the engine's ``max_logprobs`` allows (-1: no cap; a request's -1 asks for the whole vocabulary)."""
        for name, ids in (("stop_token_ids", self.stop_token_ids), ("logit_bias", list(self.logit_bias or {})),
                          ("allowed_token_ids", self.allowed_token_ids or [])):
            bad = [t for t in ids if not 0 <= t < vocab_size]
            if bad:
                raise _bad(name, bad, f"token ids in [0, {vocab_size})")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is None:
                continue
            if value > vocab_size:
                raise _bad(name, value, f"at most the vocabulary size, {vocab_size}")
            if max_logprobs != -1 and (vocab_size if value == -1 else value) > max_logprobs:
                raise _bad(name, value, f"at most the engine's max_logprobs, {max_logprobs}"
                                        + (f" (-1 asks for all {vocab_size})" if value == -1 else "")
                                        + "; max_logprobs=-1 (vtcore serve --max-logprobs -1) lifts the cap")

    def for_vocab(self, vocab_size: int) -> "SamplingParams":
        """These params with a count of alternatives of -1 as ``vocab_size`` (a copy: the caller's object, which
        other requests and engines may share, is left as it is)."""
        counts = {name: vocab_size for name in ("logprobs", "prompt_logprobs") if getattr(self, name) == -1}
        return attrs.evolve(self, **counts) if counts else self

    def truncated(self, ids: list[int], max_model_len: int) -> list[int]:
        """The prompt ids ``truncate_prompt_tokens`` keeps: the last k (-1: the last ``max_model_len``)."""
        keep = max_model_len if self.truncate_prompt_tokens == -1 else self.truncate_prompt_tokens
        if keep is not None and keep > max_model_len:
            raise _bad("truncate_prompt_tokens", keep, f"at most the model's context length, max_model_len="
                                                       f"{max_model_len} (or -1 for it)")
        return ids if keep is None or len(ids) <= keep else ids[len(ids) - keep:]


def _finite(value: int | float) -> bool:
    try:
        return math.isfinite(value)
    except OverflowError:  # an int past float's range
        return False


def _listed(name: str, value: Any, expected: str, item: Callable[[Any], Any], non_empty: bool = False) -> list:
    """``value`` (any iterable but a string or a mapping, as vLLM's ``list(...)`` takes it; or None) as a new
    list of items ``item`` accepts (and not empty, if ``non_empty``); anything else is refused naming ``name``."""
    if value is not None and (isinstance(value, (str, bytes, dict)) or not isinstance(value, Iterable)):
        raise _bad(name, value, expected)
    items = [as_int(v) for v in value or []]
    if not all(item(v) for v in items) or (non_empty and not items):
        raise _bad(name, items, expected)
    return items


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_id(value: Any) -> bool:
    return _is_int(value) and value >= 0
