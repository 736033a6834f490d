"""Bad requests and bad knobs: each gets a clear error naming the value, and the engine keeps serving."""
from __future__ import annotations

import pytest

from vtcore import LLM, SamplingParams
from vtcore.errors import ConfigError, NotSupportedError, RequestRejected
from vtcore.testing.oracle import near_tie_violations

MAX_MODEL_LEN = 64
VOCAB = 512
GREEDY = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)


@pytest.fixture
def llm(tiny_checkpoint) -> LLM:
    """The tiny checkpoint (no tokenizer) with a 64-token context and a 4 x 16-token KV pool; no cap on logprobs
    (the vocabulary's own bound is tested)."""
    return LLM(tiny_checkpoint[0], device="cpu", max_model_len=MAX_MODEL_LEN, num_kv_blocks=4, block_size=16,
               max_logprobs=-1)


def ids(*tokens: int) -> dict:
    return {"prompt_token_ids": list(tokens)}


def run_to_completion(engine, limit: int = 50) -> dict:
    finished = {}
    for _ in range(limit):
        if not engine.has_unfinished_requests():
            break
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = out
    assert not engine.has_unfinished_requests()
    return finished


def assert_idle(engine) -> None:
    assert engine.requests == {}
    assert not engine.has_unfinished_requests()
    assert engine.pool.num_free == engine.pool.num_blocks


# ------------------------------------------------------------------------------------ rejected prompts
@pytest.mark.parametrize("length", [MAX_MODEL_LEN, 70])
def test_prompt_longer_than_max_model_len(llm: LLM, length: int) -> None:
    with pytest.raises(RequestRejected) as exc:
        llm.generate(ids(*[1] * length), GREEDY)
    assert str(exc.value) == (f"request '0': prompt has {length} tokens, but max_model_len={MAX_MODEL_LEN} "
                              "leaves no room to generate")
    assert isinstance(exc.value, ValueError)
    assert_idle(llm.engine)


def test_request_needing_more_kv_blocks_than_the_pool(tiny_checkpoint) -> None:
    llm = LLM(tiny_checkpoint[0], device="cpu", num_kv_blocks=2, block_size=16)
    with pytest.raises(RequestRejected) as exc:
        llm.generate(ids(*[1] * 10), SamplingParams(max_tokens=40))
    assert str(exc.value) == ("request '0': up to 50 tokens need 4 KV blocks, but the pool holds 2 "
                              "(raise num_kv_blocks or lower max_tokens)")
    # max_tokens=None means "up to the context length" (256 here): 16 blocks
    with pytest.raises(RequestRejected, match="up to 256 tokens need 16 KV blocks, but the pool holds 2"):
        llm.generate(ids(*[1] * 10), SamplingParams(max_tokens=None))
    # what fits the pool still runs: 10 + 22 tokens = 2 blocks
    out = llm.generate(ids(*[1] * 10), SamplingParams(temperature=0.0, max_tokens=22, ignore_eos=True))
    assert len(out[0].outputs[0].token_ids) == 22
    assert_idle(llm.engine)


@pytest.mark.parametrize("prompt, bad", [
    ([1, 2, VOCAB], [VOCAB]),
    ([1, 10**9, 3], [10**9]),
    ([-1, 5], [-1]),
    ([3, -7, VOCAB + 1], [-7, VOCAB + 1]),
])
def test_prompt_ids_outside_the_vocabulary(llm: LLM, prompt: list, bad: list) -> None:
    with pytest.raises(RequestRejected) as exc:
        llm.generate(ids(*prompt), GREEDY)
    assert str(exc.value) == f"prompt_token_ids {bad}: outside the vocabulary [0, {VOCAB})"


@pytest.mark.parametrize("prompt", [[1, "2"], [1, 2.0], [True], "not a list"])
def test_prompt_ids_that_are_not_ints(llm: LLM, prompt) -> None:
    with pytest.raises(ValueError) as exc:
        llm.generate({"prompt_token_ids": prompt}, GREEDY)
    assert str(exc.value) == f"prompt_token_ids={prompt!r}: expected a list of ints"


def test_prompt_of_the_wrong_type(llm: LLM) -> None:
    with pytest.raises(ValueError, match=r"prompt=\{'prompt': 5\}: expected a string or a dict with 'prompt' \(a "
                                         r"string\) or 'prompt_token_ids'"):
        llm.generate({"prompt": 5}, GREEDY)


def test_a_prompt_key_the_engine_does_not_take_is_named(llm: LLM) -> None:
    """(vLLM's multi-modal prompts included: a text-only engine would otherwise drop the image silently.)"""
    with pytest.raises(ValueError, match=r"prompt keys \['multi_modal_data', 'text'\]: not prompt fields this engine "
                                         r"takes; expected \['cache_salt', 'prompt', 'prompt_token_ids'\]"):
        llm.generate({"text": "hi", "prompt": "hi", "multi_modal_data": {"image": None}}, GREEDY)


def test_empty_prompt(llm: LLM) -> None:
    with pytest.raises(RequestRejected) as exc:
        llm.generate(ids(), GREEDY)
    assert str(exc.value) == "request '0': the prompt is empty; expected at least one token"


@pytest.mark.parametrize("text", ["Hello", ""])
def test_text_prompt_without_tokenizer(llm: LLM, tiny_checkpoint, text: str) -> None:
    assert llm.engine.tokenizer is None
    with pytest.raises(ValueError) as exc:
        llm.generate(text, GREEDY)
    assert str(exc.value) == (f"text prompt given, but the checkpoint {tiny_checkpoint[0]!r} has no tokenizer; "
                              "pass {'prompt_token_ids': [...]} instead")
    with pytest.raises(ValueError, match="has no tokenizer with a chat template"):
        llm.chat([{"role": "user", "content": text}])


# ----------------------------------------------------------------------------------- SamplingParams
@pytest.mark.parametrize("kwargs, field, shown", [
    (dict(temperature=-1), "temperature", "-1"),
    (dict(temperature=float("nan")), "temperature", "nan"),
    (dict(temperature="0.5"), "temperature", "'0.5'"),
    (dict(top_p=0), "top_p", "0"),
    (dict(top_p=1.5), "top_p", "1.5"),
    (dict(top_k=-2), "top_k", "-2"),
    (dict(top_k=2.5), "top_k", "2.5"),
    (dict(min_p=2), "min_p", "2"),
    (dict(min_p=-0.1), "min_p", "-0.1"),
    (dict(max_tokens=-1), "max_tokens", "-1"),
    (dict(max_tokens=True), "max_tokens", "True"),
    (dict(min_tokens=5, max_tokens=2), "min_tokens", "5"),
    (dict(min_tokens=-1), "min_tokens", "-1"),
    (dict(logprobs=-2), "logprobs", "-2"),
    (dict(prompt_logprobs=-2), "prompt_logprobs", "-2"),
    (dict(temperature=float("inf")), "temperature", "inf"),
    (dict(repetition_penalty=float("inf")), "repetition_penalty", "inf"),
    (dict(stop=5), "stop", "5"),
    (dict(stop_token_ids=5), "stop_token_ids", "5"),
    (dict(allowed_token_ids=5), "allowed_token_ids", "5"),
    (dict(bad_words=5), "bad_words", "5"),
    (dict(bad_words=[" \t\n"]), "bad_words", "[' \\t\\n']"),
    (dict(skip_special_tokens="no"), "skip_special_tokens", "'no'"),
    (dict(ignore_eos=1), "ignore_eos", "1"),
    (dict(detokenize=None), "detokenize", "None"),
    (dict(stop=["x"], detokenize=False), "stop", "['x']"),
    (dict(extra_args=[1]), "extra_args", "[1]"),
    (dict(stop=[""]), "stop", "['']"),
    (dict(stop=""), "stop", "['']"),
    (dict(stop=["ok", 3]), "stop", "['ok', 3]"),
    (dict(stop_token_ids=[-1]), "stop_token_ids", "[-1]"),
    (dict(stop_token_ids=[1, "2"]), "stop_token_ids", "[1, '2']"),
    (dict(repetition_penalty=0), "repetition_penalty", "0"),
    (dict(presence_penalty=3), "presence_penalty", "3"),
    (dict(frequency_penalty=-2.5), "frequency_penalty", "-2.5"),
    (dict(logit_bias="x"), "logit_bias", "'x'"),
    (dict(logit_bias={1: "big"}), "logit_bias", "{1: 'big'}"),
    (dict(seed=1.5), "seed", "1.5"),
    (dict(seed=2 ** 64), "seed", str(2 ** 64)),
    (dict(seed=-2 ** 63 - 1), "seed", str(-2 ** 63 - 1)),
    (dict(logit_bias={3: float("nan")}), "logit_bias", "{3: nan}"),
    (dict(logit_bias={3: float("inf")}), "logit_bias", "{3: inf}"),
    (dict(output_kind="delta"), "output_kind", "'delta'"),
    (dict(n=0), "n", "0"),
    (dict(n=2.0), "n", "2.0"),
])
def test_bad_sampling_params_name_the_field(kwargs: dict, field: str, shown: str) -> None:
    with pytest.raises(ValueError) as exc:
        SamplingParams(**kwargs)
    assert str(exc.value).startswith(f"SamplingParams.{field}={shown}: expected ")


@pytest.mark.parametrize("kwargs, text", [
    (dict(best_of=2), "SamplingParams.best_of=2: only None or 1 is supported"),
    (dict(use_beam_search=True), "SamplingParams.use_beam_search=True: beam search is not supported"),
])
def test_unsupported_sampling_features(kwargs: dict, text: str) -> None:
    with pytest.raises(NotSupportedError) as exc:
        SamplingParams(**kwargs)
    assert isinstance(exc.value, NotImplementedError)
    assert text in str(exc.value)


@pytest.mark.parametrize("kwargs, field, bad", [
    (dict(stop_token_ids=[3, VOCAB]), "stop_token_ids", [VOCAB]),
    (dict(stop_token_ids=[10**6]), "stop_token_ids", [10**6]),
    (dict(logit_bias={VOCAB + 5: 1.0}), "logit_bias", [VOCAB + 5]),
    (dict(logit_bias={-3: 1.0}), "logit_bias", [-3]),
])
def test_token_ids_in_params_outside_the_vocab_rejected_at_add_request(llm: LLM, kwargs: dict, field: str,
                                                                        bad: list) -> None:
    params = SamplingParams(**kwargs)  # fine on its own: the vocabulary is the engine's
    with pytest.raises(ValueError) as exc:
        llm.engine.add_request("r", ids(1, 2), params)
    assert str(exc.value) == f"SamplingParams.{field}={bad!r}: expected token ids in [0, {VOCAB})"
    assert_idle(llm.engine)


@pytest.mark.parametrize("field", ["logprobs", "prompt_logprobs"])
def test_more_logprobs_than_the_vocab_rejected_at_add_request(llm: LLM, field: str) -> None:
    """Accepted, this failed inside the step (topk past the vocabulary) and left the engine unusable."""
    with pytest.raises(ValueError) as exc:
        llm.engine.add_request("r", ids(1, 2), SamplingParams(**{field: VOCAB + 1}))
    assert str(exc.value) == f"SamplingParams.{field}={VOCAB + 1}: expected at most the vocabulary size, {VOCAB}"
    assert_idle(llm.engine)
    assert len(llm.generate(ids(1, 2), SamplingParams(max_tokens=2, **{field: VOCAB}))[0].outputs[0].token_ids) == 2


def test_extreme_but_valid_sampling_values_still_sample(llm: LLM) -> None:
    """Values that overflow int64 or underflow float32 (they once crashed the step or masked every
    token): a huge top_k is no top-k, a temperature under 1e-5 is greedy, a top_p below float32's
    least keeps the most likely token, a -inf bias bans a token."""
    greedy = llm.generate(ids(1, 2), GREEDY)[0].outputs[0].token_ids
    for kw in (dict(top_k=2 ** 63, temperature=0.0), dict(temperature=1e-40), dict(temperature=1.0, top_p=1e-300)):
        out = llm.generate(ids(1, 2), SamplingParams(max_tokens=4, ignore_eos=True, **kw))[0].outputs[0]
        assert out.token_ids == greedy, kw
    sampled = llm.generate(ids(1, 2), SamplingParams(top_k=2 ** 63, max_tokens=4, ignore_eos=True, seed=1))
    assert len(sampled[0].outputs[0].token_ids) == 4
    banned = SamplingParams(max_tokens=4, ignore_eos=True, temperature=0.0, logit_bias={greedy[0]: float("-inf")})
    assert llm.generate(ids(1, 2), banned)[0].outputs[0].token_ids[0] != greedy[0]


def test_sampling_params_of_the_wrong_type(llm: LLM) -> None:
    with pytest.raises(TypeError, match=r"sampling_params=\{'temperature': 0\}: expected a SamplingParams"):
        llm.engine.add_request("r", ids(1, 2), {"temperature": 0})


# ------------------------------------------------------------------------------- the engine goes on
def test_engine_keeps_serving_after_rejected_add_request(tiny_checkpoint) -> None:
    llm = LLM(tiny_checkpoint[0], device="cpu", max_model_len=MAX_MODEL_LEN, num_kv_blocks=3, block_size=16)
    engine = llm.engine
    engine.add_request("a", ids(1, 2, 3), GREEDY)
    while engine.requests["a"].num_output_tokens < 1:  # "a" is running: prefilled, first token sampled
        engine.step()
    assert engine.requests["a"].num_output_tokens == 1
    with pytest.raises(RequestRejected, match="prompt has 70 tokens, but max_model_len=64"):
        engine.add_request("b", ids(*[1] * 70), GREEDY)
    with pytest.raises(RequestRejected, match="outside the vocabulary"):
        engine.add_request("c", ids(1, VOCAB), GREEDY)
    with pytest.raises(RequestRejected, match="the prompt is empty"):
        engine.add_request("d", ids(), GREEDY)
    with pytest.raises(ValueError, match="stop_token_ids"):
        engine.add_request("e", ids(1), SamplingParams(stop_token_ids=[VOCAB]))
    with pytest.raises(RequestRejected, match="up to 62 tokens need 4 KV blocks, but the pool holds 3"):
        engine.add_request("f", ids(1, 2), SamplingParams(max_tokens=60))
    engine.add_request("g", ids(4, 5), GREEDY)
    assert set(engine.requests) == {"a", "g"}
    finished = run_to_completion(engine)
    assert set(finished) == {"a", "g"}
    for out in finished.values():
        assert len(out.outputs[0].token_ids) == 4
        assert out.outputs[0].finish_reason == "length"
    assert_idle(engine)
    # the survivors' tokens are right (HF oracle, near-tie rule)
    hf = tiny_checkpoint[1]
    assert near_tie_violations(hf, [1, 2, 3], finished["a"].outputs[0].token_ids) == []
    assert near_tie_violations(hf, [4, 5], finished["g"].outputs[0].token_ids) == []
    # a rejected id was never taken: it can be used now
    engine.add_request("b", ids(1, 2, 3), GREEDY)
    assert len(run_to_completion(engine)["b"].outputs[0].token_ids) == 4


def test_generate_works_after_a_bad_prompt_in_a_list(llm: LLM) -> None:
    good = [ids(1, 2, 3), ids(9, 8)]
    expected = [o.outputs[0].token_ids for o in llm.generate(good, GREEDY)]
    for bad in (ids(1, VOCAB), ids(), ids(*[1] * 70), "text"):
        with pytest.raises(ValueError):  # RequestRejected is a ValueError
            llm.generate([good[0], bad, good[1]], GREEDY)
        assert_idle(llm.engine)
        with pytest.raises(ValueError):
            llm.generate([bad] + good, GREEDY)
        assert_idle(llm.engine)
    outs = llm.generate(good, GREEDY)
    assert [o.outputs[0].token_ids for o in outs] == expected
    assert [o.outputs[0].finish_reason for o in outs] == ["length", "length"]


def test_duplicate_request_id(llm: LLM) -> None:
    engine = llm.engine
    engine.add_request("dup", ids(1, 2, 3), GREEDY)
    with pytest.raises(ValueError) as exc:
        engine.add_request("dup", ids(4, 5), GREEDY)
    assert str(exc.value) == "request_id='dup': already in use by an unfinished request"
    finished = run_to_completion(engine)
    assert finished["dup"].prompt_token_ids == [1, 2, 3]
    assert len(finished["dup"].outputs[0].token_ids) == 4
    engine.add_request("dup", ids(4, 5), GREEDY)  # finished ids are free again
    assert run_to_completion(engine)["dup"].prompt_token_ids == [4, 5]
    assert_idle(engine)


def test_sampling_params_list_of_the_wrong_length(llm: LLM) -> None:
    with pytest.raises(ValueError) as exc:
        llm.generate([ids(1), ids(2)], [GREEDY])
    assert str(exc.value) == ("sampling_params has 1 entries, expected one per prompt (2) "
                              "or a single SamplingParams")
    with pytest.raises(ValueError, match="sampling_params has 3 entries"):
        llm.generate([ids(1), ids(2)], [GREEDY] * 3)
    assert_idle(llm.engine)
    assert len(llm.generate([ids(1), ids(2)], [GREEDY, GREEDY])) == 2


# ------------------------------------------------------------------------------------------- knobs
@pytest.mark.parametrize("kwargs, text", [
    (dict(block_size=0), "block_size=0: expected a positive integer"),
    (dict(block_size=True), "block_size=True: expected a positive integer"),
    (dict(max_num_seqs=-1), "max_num_seqs=-1: expected a positive integer"),
    (dict(max_model_len=0), "max_model_len=0: expected a positive integer"),
    (dict(num_kv_blocks=0), "num_kv_blocks=0: expected a positive integer"),
    (dict(max_num_batched_tokens=-5), "max_num_batched_tokens=-5: expected a positive integer"),
    (dict(gpu_memory_utilization=1.5), "gpu_memory_utilization=1.5: expected a fraction in (0, 1]"),
    (dict(gpu_memory_utilization=0.0), "gpu_memory_utilization=0.0: expected a fraction in (0, 1]"),
    (dict(dtype="int8"), "dtype='int8': expected 'auto' or one of "
                         "['bfloat16', 'float', 'float16', 'float32', 'half']"),
    (dict(device="tpu"), "device='tpu': expected 'cpu', 'cuda' or 'cuda:N'"),
    (dict(device="meta"), "device='meta': expected 'cpu', 'cuda' or 'cuda:N'"),
    (dict(async_scheduling="off"), "async_scheduling='off': expected True or False (or None: the family decides)"),
    (dict(enforce_eager="false"), "enforce_eager='false': expected True or False"),
])
def test_bad_llm_knobs_name_themselves(tiny_checkpoint, kwargs: dict, text: str) -> None:
    with pytest.raises(ValueError) as exc:
        LLM(tiny_checkpoint[0], **kwargs)
    assert str(exc.value) == text


def test_max_model_len_past_the_trained_positions_is_refused(tiny_checkpoint) -> None:
    """As vLLM: a context longer than ``max_position_embeddings`` would run RoPE at positions the model
    never saw; refused before the weights load, naming both numbers (equal is fine)."""
    with pytest.raises(ConfigError) as exc:
        LLM(tiny_checkpoint[0], device="cpu", max_model_len=257)
    assert str(exc.value).startswith("max_model_len=257 exceeds the model's max_position_embeddings=256 (")
    assert str(exc.value).endswith("pass max_model_len <= 256")
    assert LLM(tiny_checkpoint[0], device="cpu", max_model_len=256, num_kv_blocks=4).engine.max_model_len == 256


def test_unknown_llm_knob(tiny_checkpoint) -> None:
    with pytest.raises(TypeError) as exc:
        LLM(tiny_checkpoint[0], max_batch_size=4)
    assert str(exc.value).startswith("LLM(): ")
    assert "max_batch_size" in str(exc.value)
    assert "knobs are those of vtcore.config.EngineConfig: model, tokenizer, " in str(exc.value)


@pytest.mark.parametrize("async_scheduling", [False, True])
@pytest.mark.parametrize("where", ["host", "device"])
def test_a_failed_step_fails_its_call_and_the_engine_serves_on(tiny_checkpoint, monkeypatch, where: str,
                                                               async_scheduling: bool) -> None:
    """A step that raises (a bug, an out-of-memory) while preparing the batch on the host or in its
    device work: ``generate`` raises it, aborts its own requests, and the engine is left idle and
    serving (once, the failed step kept its staging buffer and every later step refused to run)."""
    llm = LLM(tiny_checkpoint[0], device="cpu", max_model_len=MAX_MODEL_LEN, num_kv_blocks=8, block_size=16,
              async_scheduling=async_scheduling)
    want = llm.generate([ids(1, 2), ids(3)], GREEDY)
    target, name = ((llm.engine.runner.sampler, "prepare") if where == "host"
                    else (llm.engine.runner.model, "compute_logits"))
    real, calls = getattr(target, name), []

    def fail_on_the_third(*args, **kwargs):
        calls.append(1)
        if len(calls) == 3:
            raise RuntimeError("injected")
        return real(*args, **kwargs)

    monkeypatch.setattr(target, name, fail_on_the_third)
    with pytest.raises(RuntimeError, match="injected"):
        llm.generate([ids(1, 2), ids(3)], GREEDY)
    assert_idle(llm.engine)
    got = llm.generate([ids(1, 2), ids(3)], GREEDY)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]


def test_generation_config_sampling_values_are_the_defaults(tiny_checkpoint, tmp_path) -> None:
    """As vLLM (``generation_config="auto"``): the checkpoint's generation_config.json sampling values
    (Qwen3 ships temperature 0.6, top_p 0.95, top_k 20) are what ``generate`` uses when given no
    SamplingParams; ``generation_config="vllm"`` ignores them."""
    import json
    import shutil

    path = str(tmp_path / "ckpt")
    shutil.copytree(tiny_checkpoint[0], path)
    with open(f"{path}/generation_config.json", "w") as f:
        json.dump({"temperature": 0.0, "top_k": 5, "max_new_tokens": 5, "do_sample": True}, f)
    llm = LLM(path, device="cpu", max_model_len=MAX_MODEL_LEN, num_kv_blocks=8, block_size=16)
    defaults = llm.get_default_sampling_params()
    assert (defaults.temperature, defaults.top_k, defaults.max_tokens) == (0.0, 5, 5)
    out = llm.generate(ids(1, 2))[0].outputs[0]
    assert out.token_ids == llm.generate(ids(1, 2), SamplingParams(temperature=0, max_tokens=5))[0].outputs[0].token_ids
    plain = LLM(path, device="cpu", max_model_len=MAX_MODEL_LEN, num_kv_blocks=8, block_size=16,
                generation_config="vllm").get_default_sampling_params()
    assert (plain.temperature, plain.top_k, plain.max_tokens) == (1.0, 0, 16)
    with pytest.raises(ValueError, match=r"generation_config='hf': expected 'auto'"):
        LLM(path, device="cpu", generation_config="hf")
    with open(f"{path}/generation_config.json", "w") as f:
        json.dump({"temperature": -1}, f)
    with pytest.raises(ValueError, match=r"generation_config.json: SamplingParams.temperature=-1: expected .* "
                                         r"\(or pass generation_config='vllm'"):
        LLM(path, device="cpu")
    assert LLM(path, device="cpu", generation_config="vllm").get_default_sampling_params().temperature == 1.0


def test_sampling_params_clone_is_an_independent_copy() -> None:
    p = SamplingParams(temperature=0.5, stop=["x"], stop_token_ids=[3], logit_bias={4: 1.0}, seed=7)
    q = p.clone()
    assert q == p and q is not p
    q.stop.append("y")
    q.stop_token_ids.append(5)
    q.logit_bias[6] = 2.0
    assert (p.stop, p.stop_token_ids, p.logit_bias) == (["x"], [3], {4: 1.0})


def test_a_bad_word_of_a_control_character_is_a_word() -> None:
    """White space is ASCII's, as the server's JSON Schema pattern says (Python's ``strip`` also takes \\x1c-\\x1f,
    which schemathesis sent as schema-valid words)."""
    assert SamplingParams(bad_words=["\x1e"]).bad_words == ["\x1e"]
