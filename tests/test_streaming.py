"""Incremental detokenization: streamed pieces concatenate to the final text, split UTF-8 included."""
from __future__ import annotations

import os
import shutil

import pytest

from vtcore import SamplingParams
from vtcore.engine.detokenizer import IncrementalDetokenizer
from vtcore.sampling_params import RequestOutputKind

TEXT = "Grüße aus Köln: naïve café, 日本語のテキスト, emoji 🙂🚀 and plain ascii words. " * 4


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory: pytest.TempPathFactory):
    """A byte-level BPE tokenizer of 300 tokens, so multi-byte characters span several tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<|endoftext|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator([TEXT] * 3, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>")
    path = str(tmp_path_factory.mktemp("tok"))
    fast.save_pretrained(path)
    return fast, path


def test_split_characters_are_held_until_complete(tokenizer) -> None:
    fast, _ = tokenizer
    ids = fast.encode(TEXT)
    split = [i for i in ids if "\ufffd" in fast.decode([i])]
    assert split, "the fixture must split some character across tokens"
    detok = IncrementalDetokenizer(fast, [], True, [], False)
    pieces = []
    for token in ids:
        before = len(detok.text)
        detok.add(token)
        pieces.append(detok.text[before:])
    assert all("\ufffd" not in p for p in pieces)
    assert "".join(pieces) == TEXT == fast.decode(ids)


@pytest.mark.parametrize("skip", [True, False])
def test_the_rust_decode_stream_streams_what_two_decodes_stream(tokenizer, skip, monkeypatch) -> None:
    """The fast path (``tokenizers``' DecodeStream) against the two-``decode`` algorithm it replaces, piece by
    piece: the fixture's split characters, and the embedded default's tokenizer over random ids (special
    tokens among them) after a prompt."""
    import random

    from transformers import AutoTokenizer

    from vtcore.config import DEFAULT_MODEL
    from vtcore.engine import detokenizer

    default = AutoTokenizer.from_pretrained(DEFAULT_MODEL)
    rng = random.Random(3)
    cases = [(tokenizer[0], [], tokenizer[0].encode(TEXT)),
             (default, [rng.randrange(len(default)) for _ in range(9)], [rng.randrange(len(default)) for _ in range(300)])]

    def pieces(tok, prompt, ids):
        detok = IncrementalDetokenizer(tok, prompt, skip, [], False)
        out = []
        for token in ids:
            before = len(detok.text)
            detok.add(token)
            out.append(detok.text[before:])
        detok.flush()
        return out, detok.text, detok._stream is not None

    for tok, prompt, ids in cases:
        fast, fast_text, streamed = pieces(tok, prompt, ids)
        with monkeypatch.context() as m:
            m.setattr(detokenizer, "_decode_stream", lambda *a: (None, None))
            slow, slow_text, _ = pieces(tok, prompt, ids)
        assert streamed and fast == slow and fast_text == slow_text


def test_stop_string_is_cut_and_never_streamed(tokenizer) -> None:
    fast, _ = tokenizer
    ids = fast.encode(TEXT)
    detok = IncrementalDetokenizer(fast, [], True, ["café"], False)
    shown, stop = "", None
    for token in ids:
        stop = detok.add(token)
        shown = detok.visible_text(finished=stop is not None)
        if stop:
            break
    assert stop == "café"
    assert shown == TEXT[:TEXT.index("café")]


@pytest.fixture(scope="module")
def llm_with_tokenizer(tiny_checkpoint, tokenizer, tmp_path_factory):
    from vtcore import LLM

    path = str(tmp_path_factory.mktemp("ckpt-tok"))
    shutil.copytree(tiny_checkpoint[0], path, dirs_exist_ok=True)
    for name in os.listdir(tokenizer[1]):
        shutil.copy(os.path.join(tokenizer[1], name), path)
    return LLM(path, device="cpu", block_size=8, num_kv_blocks=64)


def test_streamed_deltas_concatenate_to_final_text(llm_with_tokenizer, tokenizer) -> None:
    fast, _ = tokenizer
    engine = llm_with_tokenizer.engine
    for seed in range(3):
        params = SamplingParams(temperature=1.0, seed=seed, max_tokens=40, ignore_eos=True,
                                output_kind=RequestOutputKind.DELTA)
        engine.add_request(f"s{seed}", "Grüße aus", params)
        pieces, tokens = [], []
        while engine.has_unfinished_requests():
            for out in engine.step():
                pieces.append(out.outputs[0].text)
                tokens += out.outputs[0].token_ids
        assert len(tokens) == 40
        assert "".join(pieces) == fast.decode(tokens, skip_special_tokens=True)


def test_text_prompt_and_stop_string_through_engine(llm_with_tokenizer) -> None:
    greedy = llm_with_tokenizer.generate("Grüße", SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))[0]
    text = greedy.outputs[0].text
    assert len(greedy.outputs[0].token_ids) == 24 and text
    stop = text[len(text) // 2:len(text) // 2 + 2]
    cut = llm_with_tokenizer.generate("Grüße", SamplingParams(temperature=0, max_tokens=24, ignore_eos=True,
                                                              stop=[stop]))[0].outputs[0]
    assert cut.finish_reason == "stop" and cut.stop_reason == stop
    assert cut.text == text[:text.index(stop)]


def test_offline_generate_returns_whole_outputs_for_every_kind_and_prompt_form(llm_with_tokenizer) -> None:
    """``LLM.generate`` returns the final, whole output whatever ``output_kind`` asks of a stream (vLLM's
    LLM does the same; a DELTA request once returned only its last piece), and takes vLLM's
    ``{"prompt": text}`` form as the plain string."""
    llm = llm_with_tokenizer
    want = llm.generate("Grüße", SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))[0].outputs[0]
    for kind in RequestOutputKind:
        params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, output_kind=kind)
        for prompt in ("Grüße", {"prompt": "Grüße"}):
            out = llm.generate(prompt, params)[0]
            assert (out.outputs[0].text, out.outputs[0].token_ids) == (want.text, want.token_ids), (kind, prompt)
            assert out.prompt == "Grüße" and out.finished
        assert params.output_kind is kind  # the caller's params are not changed
