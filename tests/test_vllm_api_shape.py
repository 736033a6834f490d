"""Where vLLM's Python API and vtcore's met differently (an outside audit, as a vLLM user): a stop token's text
left out of the output, the prompt's logprobs once in a DELTA stream, the checkpoint's sampling defaults in
``AsyncLLM`` too, OpenAI-style content parts in ``LLM.chat``, the template switches through
``chat_template_kwargs``, ``logprobs=-1``, ``detokenize=False``, ``seed=-1``, vLLM's member names, and clear
refusals of what used to raise from deep inside."""
from __future__ import annotations

import asyncio
import time
from typing import Any, Iterator

import pytest

from tests.server_harness import needs_default_model
from vtcore import LLM, AsyncLLM, SamplingParams
from vtcore.config import EngineConfig
from vtcore.errors import EngineDeadError, NotSupportedError
from vtcore.sampling_params import RequestOutputKind

pytestmark = needs_default_model
PROMPT = "A friend is"


def greedy(n: int, **kw: Any) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, **kw)


@pytest.fixture(scope="module")
def llm() -> Iterator[LLM]:
    engine = LLM(device="cpu", num_kv_blocks=256, max_logprobs=-1)  # (the whole-vocabulary logprobs test)
    yield engine
    engine.shutdown()


def _stream(llm: AsyncLLM, prompt: Any, params: SamplingParams | None, rid: str = "r") -> list:
    async def run() -> list:
        return [o async for o in llm.generate(prompt, params, rid)]
    return asyncio.run(run())


def test_a_stop_tokens_text_is_left_out_unless_asked_for(llm: LLM) -> None:
    """As vLLM's detokenizer: a request that a stop token (or EOS) ends has the text of the tokens before it; with
    include_stop_str_in_output the token's too. The same from an engine core's front end, which makes the text of
    requests without stop strings."""
    tokens = llm.generate(PROMPT, greedy(8))[0].outputs[0].token_ids
    stop = tokens[4]
    tok = llm.get_tokenizer()
    out = llm.generate(PROMPT, greedy(8, stop_token_ids=[stop]))[0].outputs[0]
    assert out.token_ids == tokens[:tokens.index(stop) + 1] and out.stop_reason == stop
    assert out.text == tok.decode(out.token_ids[:-1]) != tok.decode(out.token_ids)
    kept = llm.generate(PROMPT, greedy(8, stop_token_ids=[stop], include_stop_str_in_output=True))[0].outputs[0]
    assert kept.text == tok.decode(out.token_ids)
    eos = llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=200, skip_special_tokens=False))[0].outputs[0]
    assert eos.finish_reason == "stop" and eos.token_ids[-1] in llm.engine.eos_token_ids
    assert eos.text == tok.decode(eos.token_ids[:-1], skip_special_tokens=False)
    core = AsyncLLM(device="cpu", num_kv_blocks=256, engine_core_process=True)
    try:
        for params in (greedy(8, stop_token_ids=[stop]),
                       greedy(8, stop_token_ids=[stop], output_kind=RequestOutputKind.DELTA),
                       greedy(8, stop_token_ids=[stop], include_stop_str_in_output=True)):
            sent = time.monotonic()
            outs = _stream(core, PROMPT, params)
            # (the engine core's timestamps on the front end's clock: time.monotonic is one clock for both)
            assert sent <= outs[-1].metrics.queued_ts <= outs[-1].metrics.scheduled_ts <= time.monotonic()
            text = "".join(o.outputs[0].text for o in outs) if params.output_kind == RequestOutputKind.DELTA \
                else outs[-1].outputs[0].text
            assert text == (kept.text if params.include_stop_str_in_output else out.text)
    finally:
        core.shutdown()


def test_a_delta_stream_carries_the_prompts_logprobs_once_and_defaults_come_from_the_checkpoint(
        default_model_with) -> None:
    path = default_model_with(max_new_tokens=3, temperature=0.0)
    engine = AsyncLLM(path, device="cpu", num_kv_blocks=256)
    try:
        outs = _stream(engine, PROMPT, greedy(4, prompt_logprobs=2, output_kind=RequestOutputKind.DELTA))
        assert [o.prompt_logprobs is not None for o in outs] == [True, False, False, False]
        assert len(outs[0].prompt_logprobs) == len(outs[0].prompt_token_ids)
        final = _stream(engine, PROMPT, None, "defaults")[-1].outputs[0]  # the checkpoint's 3 greedy tokens
        assert final.token_ids == _stream(engine, PROMPT, greedy(3), "greedy")[-1].outputs[0].token_ids
        assert engine.get_default_sampling_params().max_tokens == 3
    finally:
        engine.shutdown()


def test_chat_takes_text_parts_and_the_switches_through_chat_template_kwargs(llm: LLM) -> None:
    plain = [{"role": "user", "content": "Hi there"}]
    parts = [{"role": "user", "content": [{"type": "text", "text": "Hi"}, {"type": "text", "text": "there"}]}]
    joined = [{"role": "user", "content": "Hi\nthere"}]
    assert llm.chat(parts, greedy(3))[0].prompt == llm.chat(joined, greedy(3))[0].prompt != \
        llm.chat(plain, greedy(3))[0].prompt
    going_on = plain + [{"role": "assistant", "content": "Hello"}]
    by_kwargs = llm.chat(going_on, greedy(3), chat_template_kwargs={"add_generation_prompt": False,
                                                                    "continue_final_message": True})[0]
    by_args = llm.chat(going_on, greedy(3), add_generation_prompt=False, continue_final_message=True)[0]
    assert by_kwargs.prompt == by_args.prompt and by_kwargs.prompt.endswith("Hello")
    for conversation, message in [([{"role": "user"}], r"messages\[0\]\.content: null; only an assistant"),
                                  ([{"role": "user", "content": [{"type": "image_url"}]}],
                                   r"messages\[0\]\.content: part of type 'image_url'; only text parts"),
                                  ([{"role": "user", "content": [{"type": "text"}]}],
                                   r"messages\[0\]\.content: a text part's text=None: expected a string"),
                                  ([{"role": "user", "content": 5}], r"messages\[0\]\.content=5: expected a string")]:
        with pytest.raises(ValueError, match=message):
            llm.chat(conversation, greedy(3))
    with pytest.raises(ValueError, match="chat template variable 'tokenize': it is one of apply_chat_template's"):
        llm.chat(plain, greedy(3), chat_template_kwargs={"tokenize": True})
    # vLLM's order of arguments (lora_request fourth) and its content-format and multimodal keywords
    ported = llm.chat(parts, greedy(3), False, None, None, "string", mm_processor_kwargs=None)[0]
    assert ported.prompt == llm.chat(joined, greedy(3))[0].prompt
    with pytest.raises(ValueError, match=r"chat_template_content_format='openai': expected 'auto' or 'string'"):
        llm.chat(plain, greedy(3), chat_template_content_format="openai")
    with pytest.raises(NotSupportedError, match=r"mm_processor_kwargs=\{'x': 1\}: text only"):
        llm.chat(plain, greedy(3), mm_processor_kwargs={"x": 1})
    with pytest.raises(NotSupportedError, match="lora_request='adapter': LoRA"):
        llm.chat(plain, greedy(3), True, "adapter")


def test_logprobs_of_the_whole_vocabulary_no_text_and_seed_minus_one(llm: LLM) -> None:
    out = llm.generate(PROMPT, greedy(2, logprobs=-1, prompt_logprobs=-1))[0]
    vocab = llm.engine.vocab_size
    assert [len(step) for step in out.outputs[0].logprobs] == [vocab, vocab]
    assert len(out.prompt_logprobs[1]) == vocab
    ids_only = llm.generate(PROMPT, greedy(5, detokenize=False))[0].outputs[0]
    assert ids_only.text == "" and ids_only.token_ids == llm.generate(PROMPT, greedy(5))[0].outputs[0].token_ids
    assert SamplingParams(seed=-1).seed is None and EngineConfig(seed=None).seed == 0
    with pytest.raises(ValueError, match=r"seed='1': expected an integer"):
        EngineConfig(seed="1")


def test_a_progress_bar_by_default_none_when_off_and_a_callers_own(llm: LLM, capsys: Any) -> None:
    """vLLM's ``use_tqdm``: on by default (finished prompts on stderr), False for none, or a tqdm-like factory."""
    llm.generate([PROMPT, PROMPT], greedy(2))
    err = capsys.readouterr().err
    assert "Processed prompts" in err and "2/2" in err, err
    llm.chat([{"role": "user", "content": "hi"}], greedy(2), use_tqdm=False)
    assert "Processed prompts" not in capsys.readouterr().err
    made = []

    class Bar:
        def __init__(self, **kw: Any) -> None:
            made.append(kw)
            self.n = 0

        def update(self, n: int) -> None:
            self.n += n

        def close(self) -> None:  # (no context manager: vLLM's factories need none)
            made.append(self.n)

    llm.generate([PROMPT] * 3, greedy(2), use_tqdm=Bar)
    assert made == [{"total": 3, "desc": "Processed prompts", "dynamic_ncols": True}, 3]
    assert not capsys.readouterr().err

    def broken(**kw: Any) -> None:
        raise RuntimeError("no terminal")

    with pytest.raises(RuntimeError, match="no terminal"):
        llm.generate([PROMPT] * 2, greedy(2), use_tqdm=broken)
    assert not llm.engine.has_unfinished_requests()  # a failed bar left no request behind


def test_refusals_name_what_is_wrong(llm: LLM) -> None:
    with pytest.raises(ValueError, match=r"prompts=None: expected a prompt"):
        llm.generate(None)
    with pytest.raises(ValueError, match=r"sampling_params=\{'temperature': 0\}: expected a SamplingParams"):
        llm.generate(PROMPT, {"temperature": 0})
    with pytest.raises(NotSupportedError, match="lora_request=.*LoRA adapters are not supported"):
        llm.generate(PROMPT, greedy(2), lora_request="adapter")
    with pytest.raises(ValueError, match=r"truncate_prompt_tokens=5000: expected at most the model's context length"):
        llm.generate(PROMPT, greedy(2, truncate_prompt_tokens=5000))
    assert llm.llm_engine is llm.engine
    other = LLM(device="cpu", num_kv_blocks=64)
    other.shutdown()
    with pytest.raises(EngineDeadError, match="the engine is shut down"):
        other.generate(PROMPT, greedy(2))


def test_async_llm_has_vllms_members_and_aborts_several_ids() -> None:
    engine = AsyncLLM(device="cpu", num_kv_blocks=256)

    async def run() -> list:
        async def one(rid: str) -> str | None:
            async for o in engine.generate(PROMPT, greedy(10_000 // 20), rid):
                if o.outputs[0].token_ids and rid == "a":
                    await engine.abort(["a", "b", "no-such-id"])
                if o.finished:
                    return o.outputs[0].finish_reason
        await engine.check_health()
        assert await engine.get_tokenizer() is engine.tokenizer
        return await asyncio.gather(one("a"), one("b"))
    try:
        assert engine.is_running and not engine.is_stopped and not engine.errored
        assert asyncio.run(run()) == ["abort", "abort"]
        with pytest.raises(ValueError, match=r"sampling_params=\{'max_tokens': 2\}: expected a SamplingParams"):
            _stream(engine, PROMPT, {"max_tokens": 2})

        async def with_lora(lora: Any) -> list:  # (vLLM's keyword: None is taken, an adapter refused)
            return [o async for o in engine.generate(PROMPT, greedy(2), f"lora-{lora}", lora_request=lora)]
        assert asyncio.run(with_lora(None))[-1].finished
        with pytest.raises(NotSupportedError, match="lora_request='adapter': LoRA adapters are not supported"):
            asyncio.run(with_lora("adapter"))
        for bad in (5, ["a", 5]):
            with pytest.raises(ValueError, match=r"request_id=.*: expected a request id \(a string\) or several"):
                asyncio.run(engine.abort(bad))
    finally:
        engine.shutdown()
    assert not engine.is_running and engine.is_stopped and not engine.errored
    with pytest.raises(EngineDeadError, match="the engine is shut down"):
        asyncio.run(engine.check_health())


def test_review_fixes_whole_vocabulary_once_sets_and_limits(llm: LLM) -> None:
    """-1 resolves per request, not on the caller's object (several requests and engines share one); a DELTA
    stream carries the prompt's logprobs whole once even when the prompt is prefilled in chunks, and an n > 1
    stream too; iterables as vLLM takes them; a number past float's range and a shared extra_args dict."""
    shared = greedy(1, logprobs=-1)
    llm.engine.add_request("shared", PROMPT, shared)
    while llm.engine.has_unfinished_requests():
        llm.engine.step()
    assert shared.logprobs == -1
    chunked = LLM(device="cpu", num_kv_blocks=256, max_num_batched_tokens=16).engine
    try:
        prompt = {"prompt_token_ids": list(range(3, 43))}  # 40 tokens: three chunks before the first token
        for n in (1, 2):
            chunked.add_request(f"n{n}", prompt, SamplingParams(n=n, temperature=1.0, seed=1, max_tokens=3,
                                                                ignore_eos=True, prompt_logprobs=1,
                                                                output_kind=RequestOutputKind.DELTA))
            carried = []  # (read as each output comes: the engine's list grows while the prompt is prefilled)
            while chunked.has_unfinished_requests():
                carried += [len(o.prompt_logprobs) for o in chunked.step() if o.prompt_logprobs is not None]
            assert carried == [40], (n, carried)
    finally:
        chunked.shutdown()
    sp = SamplingParams(stop=("a", "b"), stop_token_ids={5}, allowed_token_ids=range(3), extra_args={"k": 1})
    assert (sp.stop, sp.stop_token_ids, sp.allowed_token_ids) == (["a", "b"], [5], [0, 1, 2])
    assert sp.clone().extra_args is not sp.extra_args and sp.clone().extra_args == {"k": 1}
    with pytest.raises(ValueError, match=r"SamplingParams.temperature=1000000000.*: expected a number >= 0"):
        SamplingParams(temperature=10 ** 400)
    out = llm.generate({"prompt": PROMPT, "multi_modal_data": None},
                       greedy(2, logprobs=1, prompt_logprobs=1, detokenize=False))[0]
    assert {lp.decoded_token for step in out.outputs[0].logprobs + out.prompt_logprobs[1:] for lp in step.values()} \
        == {None}


def test_a_grammars_end_gives_the_same_text_from_the_thread_and_a_core(llm: LLM) -> None:
    """With ignore_eos the token a grammar ends on is no stopping token: both keep its text (the core's front end
    once dropped the last token of every "stop")."""
    from vtcore.structured import StructuredOutputsParams

    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, skip_special_tokens=False,
                            structured_outputs=StructuredOutputsParams(choice=["yes", "no"]))
    want = llm.generate(PROMPT, params)[0].outputs[0]
    core = AsyncLLM(device="cpu", num_kv_blocks=256, engine_core_process=True)
    try:
        got = _stream(core, PROMPT, params)[-1].outputs[0]
    finally:
        core.shutdown()
    assert want.finish_reason == got.finish_reason == "stop" and got.text == want.text and got.text != ""
