"""vLLM's ``bad_words``: the rule split between host and device against vLLM's rule written whole, the
words' spellings, and the engine's greedy tokens against HF's logits with the rule applied by hand (sync
and async scheduling, and a late draw under a grammar)."""
from __future__ import annotations

import random
from functools import partial
from types import SimpleNamespace
from typing import Any

import pytest
import torch
import transformers

from vtcore import LLM, SamplingParams
from vtcore.config import DEFAULT_MODEL
from vtcore.structured import StructuredOutputsParams
from vtcore.testing.oracle import teacher_forced_logits
from vtcore.worker.bad_words import bad_words_token_ids, row_bans
from vtcore.worker.model_runner import _sample_metas
from vtcore.worker.step import Scheduled

PROMPT = "The meaning of life is"


def banned_by_vllms_rule(words: Any, outputs: list[int]) -> set[int]:
    """vLLM's rule over the whole output so far: a word's last id where the outputs end in the rest."""
    return {w[-1] for w in words if len(w) <= len(outputs) + 1 and tuple(outputs[len(outputs) - len(w) + 1:]) == w[:-1]}


def test_the_host_and_device_split_bans_what_vllms_rule_bans() -> None:
    rng = random.Random(0)
    for _ in range(2000):
        words = tuple({tuple(rng.randrange(4) for _ in range(rng.randint(1, 4))) for _ in range(rng.randint(1, 4))})
        outputs = [rng.randrange(4) for _ in range(rng.randint(0, 6))]
        longest = max(map(len, words))
        before = outputs[:-1][max(0, len(outputs) - 1 - (longest - 2)):] if longest > 2 else []
        always, need, last = row_bans(words, before, len(outputs))
        fed = outputs[-1] if outputs else -1  # (with no output yet the fed token is the prompt's: never needed)
        got = set(always) | {tok for n, tok in zip(need, last) if n == fed}
        assert got == banned_by_vllms_rule(words, outputs), (words, outputs)


def test_each_word_is_spelled_at_a_texts_start_and_after_a_space() -> None:
    tok = transformers.AutoTokenizer.from_pretrained(DEFAULT_MODEL)
    encode = partial(tok.encode, add_special_tokens=False)
    words = spell(tok, ["life", "  the world"])  # (a leading space is dropped)
    # " the world" is another spelling of as many ids; " life" is one id against two, which vLLM does not keep
    assert words == tuple(tuple(encode(text)) for text in ("life", "the world", " the world"))
    assert len(encode(" life")) != len(encode("life")) and encode(" the world")[0] != encode("the world")[0]
    with pytest.raises(ValueError, match=r"bad_words: 'x' tokenizes to ids \[5000\] outside the vocabulary"):
        bad_words_token_ids(lambda text: [5000], ["x"], 2048)
    with pytest.raises(ValueError, match=r"SamplingParams.bad_words=\['ok', ' '\]: expected a list of words"):
        SamplingParams(bad_words=["ok", " "])


@pytest.fixture(scope="module")
def default_model() -> tuple[Any, Any]:
    tok = transformers.AutoTokenizer.from_pretrained(DEFAULT_MODEL)
    hf = transformers.AutoModelForCausalLM.from_pretrained(DEFAULT_MODEL, dtype=torch.float32).eval()
    return tok, hf


def spell(tok: Any, words: list[str]) -> Any:
    return bad_words_token_ids(partial(tok.encode, add_special_tokens=False), words, len(tok))


def spelled_span(tok: Any, ids: list[int], length: int) -> str:
    """The text of the first run of ``length`` of ``ids`` (after the first) that is one of its own spellings."""
    for i in range(1, len(ids) - length):
        text = tok.decode(ids[i:i + length])
        if tuple(ids[i:i + length]) in spell(tok, [text]):
            return text
    raise AssertionError(f"no run of {length} ids of {ids} spells itself")


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_greedy_tokens_are_hfs_argmax_with_the_words_banned(default_model: tuple[Any, Any],
                                                            async_scheduling: bool) -> None:
    tok, hf = default_model
    llm = LLM(device="cpu", seed=0, async_scheduling=async_scheduling)
    greedy = dict(temperature=0.0, max_tokens=24, ignore_eos=True)
    plain = llm.generate(PROMPT, SamplingParams(**greedy))[0].outputs[0].token_ids
    words = [spelled_span(tok, plain, 2), spelled_span(tok, plain, 3)]
    out = llm.generate(PROMPT, SamplingParams(**greedy, bad_words=words))[0]
    tokens = out.outputs[0].token_ids
    assert tokens != plain and len(tokens) == 24
    spellings = spell(tok, words)
    prompt = out.prompt_token_ids
    logits = teacher_forced_logits(hf, prompt + tokens[:-1])
    with torch.no_grad():
        for i, token in enumerate(tokens):
            x = logits[len(prompt) + i - 1].clone()
            for banned in banned_by_vllms_rule(spellings, tokens[:i]):
                x[banned] = float("-inf")
            gap = (x.max() - x[token]).item()
            assert gap < 1e-4, f"position {i}: ours {token}, expected {int(x.argmax())} (gap {gap})"
    words.append(tok.decode(plain[:1]))  # one id (two spellings of one id each): banned always
    spellings = spell(tok, words)
    drawn = llm.generate(PROMPT, SamplingParams(temperature=1.0, seed=5, max_tokens=48, ignore_eos=True,
                                                bad_words=words))[0].outputs[0].token_ids
    assert plain[0] not in drawn
    for i in range(len(drawn)):
        assert drawn[i] not in banned_by_vllms_rule(spellings, drawn[:i]), (i, drawn)


def test_a_grammars_late_draw_bans_them_too(default_model: tuple[Any, Any]) -> None:
    """Under async scheduling a constrained row is drawn again once its previous token lands (the late draw,
    which gets the fed token from the device): the words are banned there as in the sync engine's draw."""
    tok, _ = default_model
    grammar = StructuredOutputsParams(regex="[a-z ]{1,60}")
    greedy = dict(temperature=0.0, max_tokens=20, ignore_eos=True, structured_outputs=grammar)
    runs = {}
    for async_scheduling in (False, True):
        llm = LLM(device="cpu", seed=0, async_scheduling=async_scheduling)
        plain = llm.generate(PROMPT, SamplingParams(**greedy))[0].outputs[0].token_ids
        words = [spelled_span(tok, plain, 2), spelled_span(tok, plain, 3)]
        runs[async_scheduling] = plain, llm.generate(PROMPT, SamplingParams(**greedy, bad_words=words))[0]
    (plain, sync), (_, late) = runs[False], runs[True]
    tokens = sync.outputs[0].token_ids
    assert late.outputs[0].token_ids == tokens != plain
    spellings = spell(tok, words)
    for i in range(len(tokens)):
        assert tokens[i] not in banned_by_vllms_rule(spellings, tokens[:i]), (i, tokens)


def test_device_drafts_leave_a_request_with_a_word_of_several_ids_alone(default_model: tuple[Any, Any]) -> None:
    """Async n-gram drafts stay on the device, where the host cannot check a word's prefix over them: a request
    with a word of several ids gets none (as a penalised one) and its tokens are the engine's without drafts;
    one without drafts as before."""
    tok, _ = default_model
    prompt = PROMPT + " the world is" * 8  # repetitive: the n-gram has something to propose
    greedy = dict(temperature=0.0, max_tokens=24, ignore_eos=True)
    plain = LLM(device="cpu", seed=0)
    words = [spelled_span(tok, plain.generate(prompt, SamplingParams(**greedy))[0].outputs[0].token_ids, 3)]
    spec = LLM(device="cpu", seed=0, async_scheduling=True,
               speculative_config={"method": "ngram", "num_speculative_tokens": 3})
    stats = spec.engine.spec_stats
    got = spec.generate(prompt, SamplingParams(**greedy, bad_words=words))[0].outputs[0].token_ids
    assert stats.num_draft_tokens == 0
    assert got == plain.generate(prompt, SamplingParams(**greedy, bad_words=words))[0].outputs[0].token_ids
    spec.generate(prompt, SamplingParams(**greedy))
    assert stats.num_draft_tokens > 0


def test_a_verify_rows_samples_see_the_tokens_before_each_fed_one() -> None:
    """A verify row samples after its last token and after each draft token: each sample's history (what
    penalties and bad words read) is the sequence before the token it was fed, at any tail length."""
    req = SimpleNamespace(token_ids=[10, 11, 12, 100, 101], num_prompt_tokens=3, bad_words=())
    s = Scheduled(req, 4, 4, True, draft=(102, 103, 104))  # fed 101 at position 4, then the draft
    sequence = req.token_ids + [102, 103, 104]
    metas = _sample_metas(s)
    assert len(metas) == 4
    for i, m in enumerate(metas):
        fed_at = 4 + i
        assert m.prior_tokens == sequence[:fed_at] and m.num_outputs == fed_at + 1 - 3, i
        for k in range(1, 8):
            assert m.tail(k) == sequence[max(0, fed_at - k):fed_at], (i, k)


def test_host_drafts_in_the_sync_engine_ban_them_as_plain_decoding(default_model: tuple[Any, Any]) -> None:
    """The sync engine's n-gram drafts (verify rows whose draft the host knows) ban a word of several ids
    where plain decoding does: the same tokens, drafts accepted."""
    tok, _ = default_model
    prompt = "Repeat:" + " red green blue" * 10
    greedy = dict(temperature=0.0, max_tokens=40, ignore_eos=True)
    plain = LLM(device="cpu", seed=0)
    words = [spelled_span(tok, plain.generate(prompt, SamplingParams(**greedy))[0].outputs[0].token_ids, 3)]
    want = plain.generate(prompt, SamplingParams(**greedy, bad_words=words))[0].outputs[0].token_ids
    spec = LLM(device="cpu", seed=0, async_scheduling=False,
               speculative_config={"method": "ngram", "num_speculative_tokens": 3})
    assert spec.generate(prompt, SamplingParams(**greedy, bad_words=words))[0].outputs[0].token_ids == want
    assert spec.engine.spec_stats.num_accepted_tokens > 0


def test_a_word_that_tokenizes_to_nothing_is_named() -> None:
    """(Its first id was read before: an IndexError, a 500 on the server.)"""
    from vtcore.worker.bad_words import bad_words_token_ids

    with pytest.raises(ValueError, match=r"SamplingParams.bad_words: 'x' tokenizes to no ids"):
        bad_words_token_ids(lambda text: [], ["x"], 10)
