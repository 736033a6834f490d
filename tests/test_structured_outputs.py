"""Structured outputs (xgrammar): every sampled output of the embedded default model satisfies its
constraint, bad constraints are refused by name, and the async engine gives a constrained request
the same tokens as sync."""
from __future__ import annotations

import json
import re
import threading
import time

import jsonschema
import pytest

from vtcore import LLM, SamplingParams
from vtcore.conformance.harness import build_engine, run_engine
from vtcore.config import DEFAULT_MODEL
from vtcore.structured import StructuredOutputsParams

_INT = {"type": "integer", "minimum": -50, "maximum": 50}
_NAME = {"type": "string", "maxLength": 8}
SCHEMAS = [
    {"type": "object", "properties": {"name": _NAME, "age": {"type": "integer", "minimum": 0, "maximum": 120}},
     "required": ["name", "age"]},
    {"type": "array", "items": _INT, "minItems": 1, "maxItems": 4},
    {"type": "string", "enum": ["red", "green", "blue"]},
    {"type": "number", "minimum": 0, "maximum": 1},
    {"type": "boolean"},
    {"type": "null"},
    {"type": "integer", "minimum": 10, "maximum": 20},
    {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"], "additionalProperties": False},
    {"type": "object", "properties": {"point": {"type": "object", "properties": {"x": _INT, "y": _INT},
                                                "required": ["x", "y"]}}, "required": ["point"]},
    {"type": "array", "items": {"type": "string", "enum": ["a", "b"]}, "minItems": 2, "maxItems": 3},
    {"type": "object", "properties": {"tags": {"type": "array", "items": _NAME, "maxItems": 2}},
     "required": ["tags"]},
    {"type": "object", "properties": {"id": _INT, "note": _NAME}, "required": ["id"]},  # an optional field
    {"type": "object", "properties": {"kind": {"enum": ["cat", "dog"]}, "legs": {"type": "integer", "minimum": 0,
                                                                                   "maximum": 4}},
     "required": ["kind", "legs"]},
    {"type": "array", "items": {"type": "object", "properties": {"v": {"type": "boolean"}}, "required": ["v"]},
     "maxItems": 2},
    {"type": "string", "pattern": "^[a-c]{2,4}$"},
    {"type": "object", "properties": {"score": {"type": "number", "minimum": -1, "maximum": 1}}, "required": ["score"]},
    {"anyOf": [{"type": "integer", "minimum": 0, "maximum": 9}, {"type": "boolean"}]},
    {"type": "object", "properties": {"m": {"type": "array", "items": {"type": "array", "items": _INT, "maxItems": 2},
                                            "maxItems": 2}}, "required": ["m"]},
    {"type": "string", "minLength": 2, "maxLength": 5},
    {"type": "object", "properties": {"a": {"type": "null"}, "b": {"const": "x"}}, "required": ["a", "b"]},
    {"type": "object", "properties": {"level": {"type": "integer", "enum": [1, 2, 3]}}, "required": ["level"]},
    {"type": "array", "prefixItems": [{"type": "boolean"}, _INT], "minItems": 2, "maxItems": 2},
]


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM(device="cpu", max_num_seqs=32)


def _constrained(llm: LLM, constraints: list[dict], seed: int = 0, max_tokens: int = 400) -> list:
    params = [SamplingParams(temperature=1.0, seed=seed + i, max_tokens=max_tokens,
                             structured_outputs=StructuredOutputsParams(**c)) for i, c in enumerate(constraints)]
    return [o.outputs[0] for o in llm.generate(["Answer in JSON: "] * len(params), params, use_tqdm=False)]


def test_every_sampled_output_validates_against_its_schema(llm: LLM) -> None:
    for seed in (0, 100):
        outs = _constrained(llm, [{"json": s} for s in SCHEMAS], seed)
        for schema, out in zip(SCHEMAS, outs):
            assert out.finish_reason == "stop", (schema, out.text)
            jsonschema.validate(json.loads(out.text), schema)


def _one_layout(text: str) -> bool:
    """``text``'s white space outside its strings is json.dumps' own: one space after each comma and colon."""
    bare = re.sub(r'"(?:[^"\\]|\\.)*"', '""', text)
    return not re.search(r"[,:](?! )", bare) and not re.search(r"\s", re.sub(r"(?<=[,:]) ", "", bare))


def test_disable_any_whitespace_gives_json_in_one_layout(llm: LLM) -> None:
    """vLLM's option: the JSON kinds in json.dumps' layout (", " and ": ", no other white space), a grammar of
    its own (so the same schema without it still allows any white space: the tiny model writes some)."""
    constraints = [{"json": s} for s in SCHEMAS]
    for seed in (0, 100):
        one = _constrained(llm, [{**c, "disable_any_whitespace": True} for c in constraints], seed)
        for c, out in zip(constraints, one):
            assert out.finish_reason == "stop" and _one_layout(out.text), (c, out.text)
            json.loads(out.text)
    free = [o.text for seed in (0, 100) for o in _constrained(llm, constraints, seed)]
    assert not all(_one_layout(t) for t in free), free
    for kind in ({"json": {}}, {"json_object": True}):
        compact = StructuredOutputsParams(**kind, disable_any_whitespace=True)
        assert compact.key() != StructuredOutputsParams(**kind).key()
    assert StructuredOutputsParams(regex="a", disable_any_whitespace=True).key() == StructuredOutputsParams(
        regex="a").key()  # (no JSON: nothing to lay out)


def test_regex_choice_grammar_and_json_object(llm: LLM) -> None:
    grammar = 'root ::= "yes" | "no" | "maybe " [0-9]'
    outs = _constrained(llm, [{"regex": r"[a-z]{3}-[0-9]{2}"}, {"choice": ["alpha", "beta (2)", "c.d"]},
                              {"grammar": grammar}, {"json_object": True}], max_tokens=200)
    assert re.fullmatch(r"[a-z]{3}-[0-9]{2}", outs[0].text), outs[0].text
    assert outs[1].text in ("alpha", "beta (2)", "c.d")
    assert re.fullmatch(r"yes|no|maybe [0-9]", outs[2].text), outs[2].text
    assert outs[3].finish_reason == "stop" and isinstance(json.loads(outs[3].text), dict), outs[3].text


def test_a_finished_grammar_ends_its_request_even_with_ignore_eos(llm: LLM) -> None:
    """The grammar's own end (it accepted a stop token) stops the request, which ignore_eos would not."""
    params = SamplingParams(temperature=1.0, seed=3, max_tokens=60, ignore_eos=True,
                            structured_outputs=StructuredOutputsParams(choice=["yes", "no"]))
    out = llm.generate(["Answer: "] * 4, [params] * 4, use_tqdm=False)
    for o in out:
        assert o.outputs[0].finish_reason == "stop" and o.outputs[0].text in ("yes", "no"), o.outputs[0]
        assert len(o.outputs[0].token_ids) < 60


def test_unconstrained_requests_beside_constrained_ones_are_untouched(llm: LLM) -> None:
    plain = SamplingParams(temperature=1.0, seed=7, max_tokens=12, ignore_eos=True)
    alone = llm.generate("Hello", plain, use_tqdm=False)[0].outputs[0].token_ids
    mixed = llm.generate(["Hello", "Hello"], [plain, SamplingParams(
        temperature=1.0, seed=8, max_tokens=40, structured_outputs=StructuredOutputsParams(json=SCHEMAS[0]))],
        use_tqdm=False)
    assert mixed[0].outputs[0].token_ids == alone


@pytest.mark.parametrize("bad, named", [
    ({}, "no constraint given"),
    ({"json": {"type": "object"}, "regex": "a"}, "['json', 'regex'] given"),
    ({"json": "{not json"}, "StructuredOutputsParams.json: not valid JSON"),
    ({"choice": "abc"}, "StructuredOutputsParams.choice='abc': expected a non-empty list of strings"),
    ({"regex": ""}, "StructuredOutputsParams.regex='': expected a non-empty string"),
    ({"json_object": True, "disable_any_whitespace": 1}, "disable_any_whitespace=1: expected a bool"),
])
def test_a_bad_constraint_is_refused_by_name(bad, named) -> None:
    with pytest.raises(ValueError, match=re.escape(named)):
        StructuredOutputsParams(**bad)


@pytest.mark.parametrize("bad, named", [
    ({"grammar": "root ::= undefined_rule"}, "structured_outputs.grammar: xgrammar cannot compile it"),
    ({"regex": "(unclosed"}, "structured_outputs.regex: xgrammar cannot compile it"),
    ({"json": {"type": "no-such-type"}}, "structured_outputs.json: xgrammar cannot compile it"),
])
def test_a_constraint_xgrammar_cannot_compile_fails_alone(llm: LLM, bad, named) -> None:
    with pytest.raises(ValueError, match="^" + re.escape(named + ": ")) as exc:
        llm.generate("x", SamplingParams(max_tokens=4, structured_outputs=StructuredOutputsParams(**bad)),
                     use_tqdm=False)
    assert str(exc.value).count("cannot compile") == 1 and "/cpp/" not in str(exc.value), exc.value  # once, clean
    assert llm.generate("x", SamplingParams(max_tokens=3), use_tqdm=False)[0].outputs[0].token_ids  # still serves


def test_a_schema_is_compiled_once(llm: LLM) -> None:
    _constrained(llm, [{"json": SCHEMAS[1]}] * 3, max_tokens=60)
    compiled = llm.engine._grammar_cache._compiled
    assert sum(1 for kind, value, one_layout in compiled
               if kind == "json" and not one_layout and json.loads(value) == SCHEMAS[1]) == 1


def test_concurrent_requests_for_one_schema_compile_it_once(llm: LLM) -> None:
    """``AsyncLLM`` compiles on executor threads: a wave of requests for a new schema waits for one compile."""
    cache = llm.engine._grammars()
    original, calls = cache.compiler, []

    class Counting:
        def compile_grammar(self, grammar):
            calls.append(1)
            time.sleep(0.2)  # long enough that every thread asks while it runs
            return original.compile_grammar(grammar)

    cache.compiler = Counting()
    try:
        so = StructuredOutputsParams(json={"type": "array", "items": {"type": "boolean"}, "maxItems": 3})
        threads = [threading.Thread(target=cache.compile, args=(so,)) for _ in range(6)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        cache.compiler = original
    assert len(calls) == 1 and so.key() in cache._compiled


def test_async_gives_a_constrained_request_the_tokens_sync_gives() -> None:
    """Under async scheduling a constrained request runs in every step, its token still in flight: its
    row is drawn late, once that token landed and its mask exists; every request's tokens equal sync's
    (seeded draws included: a late row's first, unused draw takes nothing from its generator; penalties
    included: they read a late row's fed token, kept for its late draw)."""
    so = StructuredOutputsParams(json=SCHEMAS[8])
    arrivals = {0: [("c0", [5, 6, 7], SamplingParams(temperature=1.0, seed=1, max_tokens=120, structured_outputs=so)),
                    ("u0", [8, 9], SamplingParams(temperature=1.0, seed=2, max_tokens=20, ignore_eos=True))],
                2: [("c2", [3, 4], SamplingParams(temperature=0.0, max_tokens=24, repetition_penalty=1.5,
                                                  frequency_penalty=0.5, structured_outputs=so))],
                3: [("c1", [1, 2], SamplingParams(temperature=0.0, max_tokens=120, structured_outputs=so))]}
    knobs = dict(device="cpu", max_num_seqs=8)
    sync, sync_batches = run_engine(build_engine(DEFAULT_MODEL, "sync", **knobs), arrivals)
    asyn, batches = run_engine(build_engine(DEFAULT_MODEL, "async", **knobs), arrivals)
    assert asyn == sync and batches == sync_batches
    for rid in ("c0", "c1", "c2"):
        steps = [i for i, batch in enumerate(batches) if any(row[0] == rid for row in batch)]
        assert len(sync[rid]) > 5 and len(steps) == len(sync[rid])  # one step a token: the prefill, then decodes
        assert steps == list(range(steps[0], steps[0] + len(steps)))  # in consecutive steps, none skipped


def test_a_vocabulary_padded_past_the_tokenizer_keeps_its_padding_out_of_constrained_draws(tmp_path) -> None:
    """A model whose logits are wider than its tokenizer (vocab_size padded, as Qwen checkpoints are):
    the matchers hold the tokenizer's tokens only, and the padding ids stay disallowed under a grammar
    even when a logit bias makes one the unconstrained argmax (the control request takes it)."""
    import os
    import shutil

    import torch
    from safetensors.torch import load_file, save_file

    for name in os.listdir(DEFAULT_MODEL):
        if name != "model.safetensors":
            shutil.copy(os.path.join(DEFAULT_MODEL, name), tmp_path)
    weights = load_file(os.path.join(DEFAULT_MODEL, "model.safetensors"))
    embed = weights["model.embed_tokens.weight"]  # tied: the LM head too
    tokens = embed.shape[0]
    weights["model.embed_tokens.weight"] = torch.cat([embed, torch.zeros(64, embed.shape[1], dtype=embed.dtype)])
    save_file(weights, os.path.join(tmp_path, "model.safetensors"))
    config = json.loads((tmp_path / "config.json").read_text())
    config["vocab_size"] = tokens + 64
    (tmp_path / "config.json").write_text(json.dumps(config))
    padded = LLM(str(tmp_path), device="cpu")
    bias = {tokens + 52: 50.0}
    so = StructuredOutputsParams(json=SCHEMAS[7])
    held, free = padded.generate(["Answer: "] * 2, [
        SamplingParams(temperature=0, max_tokens=40, logit_bias=bias, structured_outputs=so),
        SamplingParams(temperature=0, max_tokens=3, logit_bias=bias)], use_tqdm=False)
    assert free.outputs[0].token_ids == [tokens + 52] * 3
    ids = held.outputs[0].token_ids
    assert ids and max(ids) < tokens
    cache = padded.engine._grammar_cache  # the matchers' vocabulary: the tokenizer's, not the padded one
    assert (cache.tokens, cache.words, cache.info.vocab_size) == (tokens, -(-tokens // 32), tokens)


def test_a_tokenizer_with_gaps_in_its_ids_keeps_its_highest_id_in_the_grammars() -> None:
    """Ids may leave gaps (an end-of-sequence id past the count of tokens): the matchers' vocabulary runs to
    the highest id, so the stop token stays allowed once the grammar is complete."""
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from vtcore.structured.grammar import GrammarCache, fill_bitmasks

    vocab = {chr(c): i for i, c in enumerate(range(ord("a"), ord("z") + 1))} | {"<eos>": 40}
    raw = Tokenizer(models.WordLevel(vocab, unk_token="<eos>"))
    raw.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=raw, eos_token="<eos>")
    cache = GrammarCache(tokenizer, 64, [40])
    assert (cache.tokens, cache.words) == (41, 2)
    grammar = cache.matcher(StructuredOutputsParams(regex="ab"))
    assert grammar.accept(vocab["a"]) and grammar.accept(vocab["b"])
    mask = fill_bitmasks([(grammar, 2)], torch.zeros(1, cache.words, dtype=torch.int32))
    assert (int(mask[0, 1]) >> (40 - 32)) & 1  # the stop token, allowed after the grammar
    assert grammar.accept(40) and grammar.terminated


def test_async_compiles_a_constraint_off_the_engine_thread_once_then_sends_its_requests_straight_on() -> None:
    """``AsyncLLM.generate`` compiles a new constraint on an executor thread (off the engine thread); a
    constraint already compiled goes with its request directly (an executor hop would let the request miss
    the step its unconstrained neighbours arrived for)."""
    import asyncio

    from vtcore.engine.async_llm import AsyncLLM

    engine = AsyncLLM(device="cpu", max_num_seqs=4)
    compiles = []
    original = engine.engine.compile_grammar
    engine.engine.compile_grammar = lambda c: (compiles.append((threading.current_thread(), c.key())), original(c))
    params = [SamplingParams(temperature=0, max_tokens=8, structured_outputs=StructuredOutputsParams(json=s))
              for s in (SCHEMAS[4], SCHEMAS[4], SCHEMAS[5])]

    async def run() -> list[str]:
        texts = []
        for i, p in enumerate(params):
            async for out in engine.generate({"prompt_token_ids": [5, 6, 7]}, p, request_id=f"r{i}"):
                pass
            texts.append(out.outputs[0].text)
        return texts

    try:
        texts = asyncio.run(run())
    finally:
        engine.shutdown()
    assert [key for _, key in compiles] == [params[0].structured_outputs.key(), params[2].structured_outputs.key()]
    assert all(thread is not threading.main_thread() for thread, _ in compiles)
    assert [json.loads(t) in (True, False) for t in texts[:2]] == [True, True] and json.loads(texts[2]) is None


def test_an_abort_while_its_grammar_compiles_ends_the_request_once_added() -> None:
    """``AsyncLLM.abort`` of a request whose constraint still compiles (its add not sent yet; the server's
    shutdown aborts every request so): the request is added and aborted behind it, its stream ends with
    finish_reason "abort", where the abort once reached the engine first, did nothing, and the request ran
    to its max_tokens."""
    import asyncio

    from vtcore.engine.async_llm import AsyncLLM

    engine = AsyncLLM(device="cpu", max_num_seqs=4)
    started, release = threading.Event(), threading.Event()
    original = engine.engine.compile_grammar
    engine.engine.compile_grammar = lambda c: (started.set(), release.wait(30), original(c))
    params = SamplingParams(temperature=0, max_tokens=500, ignore_eos=True,
                            structured_outputs=StructuredOutputsParams(regex="(ab)+"))

    async def run() -> list:
        async def collect() -> list:
            return [o async for o in engine.generate({"prompt_token_ids": [5, 6, 7]}, params, request_id="slow")]
        task = asyncio.create_task(collect())
        while not started.is_set():
            await asyncio.sleep(0.01)
        await engine.abort("slow")
        release.set()
        return await task

    try:
        outs = asyncio.run(run())
    finally:
        engine.shutdown()
    assert outs[-1].finished and outs[-1].outputs[0].finish_reason == "abort"
    assert len(outs[-1].outputs[0].token_ids) < 500
