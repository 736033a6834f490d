"""vLLM's ``bad_words``: each word's token id spellings, and which ids a sampling row may not draw.

A word of ids ``w`` bans its last id ``w[-1]`` wherever the request's outputs so far end in the rest,
``w[:-1]`` (vLLM's rule: outputs only, never the prompt); a one-id word is banned always. A row's last
output is the token it was fed, which under async scheduling only the device holds yet: the host checks
the outputs before it, and the device compares the fed token (``Sampler``'s ``bad_need`` / ``bad_last``).
"""
from __future__ import annotations

from typing import Callable, Sequence

from vtcore.sampling_params import ASCII_SPACE

Words = tuple[tuple[int, ...], ...]


def bad_words_token_ids(encode: Callable[[str], list[int]], words: Sequence[str], vocab_size: int) -> Words:
    """Each word as it would open a text and as it would follow a space (vLLM's two spellings; the spaced one
    only where it is another spelling of as many ids, as vLLM keeps it). ``encode``: text -> ids, no special
    tokens. An id outside the vocabulary, or no id at all, raises ``ValueError`` naming the word."""
    out: list[tuple[int, ...]] = []
    for word in words:
        plain = tuple(encode(word.lstrip(ASCII_SPACE)))  # (the white space SamplingParams' check strips)
        spaced = tuple(encode(" " + word.lstrip(ASCII_SPACE)))
        if not plain:
            raise ValueError(f"SamplingParams.bad_words: {word!r} tokenizes to no ids; expected a word the "
                             "tokenizer spells")
        spellings = [plain] + ([spaced] if spaced[0] != plain[0] and len(spaced) == len(plain) else [])
        for ids in spellings:
            bad = [t for t in ids if not 0 <= t < vocab_size]
            if bad:
                raise ValueError(f"SamplingParams.bad_words: {word!r} tokenizes to ids {bad} outside the "
                                 f"vocabulary; expected ids in [0, {vocab_size})")
            if ids not in out:
                out.append(ids)
    return tuple(out)


def read_outputs(words: Words) -> bool:
    """Whether ``words`` ban anything after earlier outputs (a word of several ids): then a row's bans read the
    token it was fed and the outputs before it."""
    return any(len(w) > 1 for w in words)


def row_bans(words: Words, before: Sequence[int], num_outputs: int) -> tuple[list[int], list[int], list[int]]:
    """For a row whose outputs so far are ``num_outputs`` tokens, the last of them the fed token and
    ``before`` (at least the longest word's length - 2 of) the ones before it: the ids banned whatever the
    fed token, and the pairs (``need``, ``last``): ``last`` is banned where the fed token is ``need``."""
    always: list[int] = []
    need: list[int] = []
    last: list[int] = []
    for w in words:
        if len(w) == 1:
            always.append(w[0])
        elif len(w) - 1 <= num_outputs and (len(w) == 2 or tuple(before[len(before) - (len(w) - 2):]) == w[:-2]):
            need.append(w[-2])
            last.append(w[-1])
    return always, need, last
