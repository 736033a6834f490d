"""vLLM's additions a client of a vLLM server relies on: ``stream_options.continuous_usage_stats``
(usage in every streamed chunk), ``POST /tokenize`` / ``POST /detokenize`` (vLLM's field names), the
sampling extras, ``return_token_ids`` and ``return_tokens_as_token_ids``."""
from __future__ import annotations

from typing import Any

import pytest
from server_harness import (API_KEY, MODEL, PROMPTS, ServerThread, client, engine, httpx,  # noqa: F401
                            keyed_server, needs_default_model, offline, server, template_server)

from vtcore import LLM, AsyncLLM, SamplingParams
from vtcore.server.app import build_app

pytestmark = needs_default_model

CONTINUOUS = {"include_usage": True, "continuous_usage_stats": True}
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "A quote?"}]


def _usages(chunks: list[Any]) -> dict[int, list[tuple[int, int, int]]]:
    """Each choice's (prompt, completion, total) tokens, chunk by chunk."""
    seen: dict[int, list[tuple[int, int, int]]] = {}
    for c in chunks:
        if c.choices:
            u = c.usage
            seen.setdefault(c.choices[0].index, []).append((u.prompt_tokens, u.completion_tokens, u.total_tokens))
    return seen


def test_continuous_usage_stats_put_each_choices_usage_in_every_chunk(client: Any, engine: AsyncLLM) -> None:
    kw = dict(model=MODEL, max_tokens=6, temperature=1.0, seed=2, n=2, extra_body={"ignore_eos": True})
    chunks = list(client.completions.create(prompt=PROMPTS[:2], stream=True, stream_options=CONTINUOUS, **kw))
    n_prompt = [len(engine.tokenize(p)[1]) for p in PROMPTS[:2]]
    per_choice = _usages(chunks)
    assert sorted(per_choice) == [0, 1, 2, 3]
    for index, usages in per_choice.items():
        completion = [u[1] for u in usages]
        assert all(u[0] == n_prompt[index // 2] and u[2] == u[0] + u[1] for u in usages)
        assert completion == sorted(completion) and completion[-1] == 6, usages
    final = chunks[-1]
    assert final.choices == [] and (final.usage.prompt_tokens, final.usage.completion_tokens) == (sum(n_prompt), 24)

    chunks = list(client.chat.completions.create(messages=MESSAGES, stream=True, stream_options=CONTINUOUS, **kw))
    n_prompt = len(engine.chat_prompt(MESSAGES)["prompt_token_ids"])
    for usages in _usages(chunks).values():
        assert usages[0] == (n_prompt, 0, n_prompt)  # the role chunk: nothing generated yet
        assert usages[-1] == (n_prompt, 6, n_prompt + 6)
    # as vLLM: without include_usage, continuous_usage_stats adds nothing
    plain = list(client.completions.create(prompt=PROMPTS[0], stream=True,
                                           stream_options={"continuous_usage_stats": True}, **kw))
    assert all(c.usage is None for c in plain)


def test_tokenize_gives_the_ids_generation_takes(server: ServerThread, client: Any, engine: AsyncLLM) -> None:
    r = httpx.post(server.url + "/tokenize", json={"model": MODEL, "prompt": PROMPTS[0], "return_token_strs": True})
    assert r.status_code == 200, r.text
    body = r.json()
    ids = engine.tokenize(PROMPTS[0])[1]
    assert body == {"count": len(ids), "max_model_len": engine.limits().max_model_len, "tokens": ids,
                    "token_strs": engine.tokenizer.convert_ids_to_tokens(ids)}
    used = client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=1).usage.prompt_tokens
    assert body["count"] == used
    r = httpx.post(server.url + "/tokenize", json={"model": MODEL, "messages": MESSAGES})
    chat = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=1)
    assert r.json()["count"] == chat.usage.prompt_tokens and r.json()["token_strs"] is None
    assert r.json()["tokens"] == engine.chat_prompt(MESSAGES)["prompt_token_ids"]
    tools = [{"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}]
    listing = "{% for t in tools %}{{ t.function.name }};{% endfor %}{% for m in messages %}{{ m.content }}{% endfor %}"
    with template_server(engine, listing) as srv:  # (the default model's template writes no tools)
        r = httpx.post(srv.url + "/tokenize", json={"model": MODEL, "messages": MESSAGES, "tools": tools})
        assert r.status_code == 200, r.text
        assert r.json()["tokens"] == engine.chat_prompt(MESSAGES, tools=tools)["prompt_token_ids"]
        assert engine.detokenize(r.json()["tokens"]).startswith("add;")


def test_detokenize_inverts_tokenize(server: ServerThread) -> None:
    text = "Grüße, 日本語 and plain words."
    ids = httpx.post(server.url + "/tokenize", json={"prompt": text}).json()["tokens"]
    r = httpx.post(server.url + "/detokenize", json={"model": MODEL, "tokens": ids})
    assert r.status_code == 200 and r.json() == {"prompt": text}


@pytest.mark.parametrize("path, body, status, param", [
    ("/tokenize", {"model": "gpt-nope", "prompt": "hi"}, 404, "model"),
    ("/tokenize", {"model": MODEL}, 400, "prompt"),  # neither prompt nor messages
    ("/tokenize", {"prompt": "hi", "messages": MESSAGES}, 400, "prompt"),  # both
    ("/tokenize", {"messages": MESSAGES, "add_special_tokens": True}, 400, "add_special_tokens"),
    ("/tokenize", {"messages": MESSAGES, "continue_final_message": True}, 400, "continue_final_message"),
    ("/tokenize", {"messages": [{"role": "user"}]}, 400, "messages"),
    ("/tokenize", {"prompt": ["a", "b"]}, 400, "prompt"),
    ("/tokenize", {"prompt": "hi", "tools": []}, 400, "tools"),
    ("/detokenize", {"tokens": [5, 10 ** 9]}, 400, "tokens"),
    ("/detokenize", {"tokens": [-1]}, 400, "tokens"),
    ("/detokenize", {"tokens": "5"}, 400, "tokens"),
])
def test_bad_tokenization_requests_name_the_field(server: ServerThread, path: str, body: dict, status: int,
                                                  param: str) -> None:
    r = httpx.post(server.url + path, json=body)
    assert r.status_code == status and r.json()["error"]["param"] == param, r.text
    if body.get("prompt") == ["a", "b"]:  # (not /v1/completions' forms, which /tokenize does not take)
        assert r.json()["error"]["message"].startswith("prompt: expected one string, the text to tokenize"), r.text


def test_the_api_key_guards_tokenization_too(keyed_server: ServerThread) -> None:
    for path, body in (("/tokenize", {"prompt": "hi"}), ("/detokenize", {"tokens": [5]})):
        assert httpx.post(keyed_server.url + path, json=body).status_code == 401
        r = httpx.post(keyed_server.url + path, json=body, headers={"authorization": f"Bearer {API_KEY}"})
        assert r.status_code == 200, r.text


def test_prompt_logprobs_are_the_engines_cut_to_each_count(client: Any, offline: LLM) -> None:  # noqa: F811
    """vLLM's ``prompt_logprobs`` in /v1/completions: per prompt position null (the first) or the prompt token's
    logprob, rank and text with the top ones, as the engine gives them offline; beside ``echo`` with other
    ``logprobs`` each gets its own count; streamed, in each choice's first chunk."""
    want = offline.generate(PROMPTS[0], SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=3))[0]
    ids = want.prompt_token_ids

    def seen(plp: list) -> list:
        return [None if pos is None else {int(t): (round(e["logprob"], 4), e["rank"], e["decoded_token"])
                                          for t, e in pos.items()} for pos in plp]

    def engine(k: int) -> list:
        return [None if pos is None else {t: (round(lp.logprob, 4), lp.rank, lp.decoded_token) for t, lp in pos.items()
                                          if t == ids[i] or lp.rank <= k} for i, pos in enumerate(want.prompt_logprobs)]

    r = client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=2, temperature=0, echo=True, logprobs=1,
                                  extra_body={"prompt_logprobs": 3})
    choice = r.choices[0]
    assert seen(choice.model_extra["prompt_logprobs"]) == engine(3) and engine(3)[0] is None
    assert all(len(pos) >= 3 for pos in engine(3)[1:])
    echoed = choice.logprobs.top_logprobs[:len(ids)]
    assert echoed[0] is None and all(len(top) in (1, 2) for top in echoed[1:])  # echo's own count: 1 (+ the token)
    assert seen(client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=2, temperature=0,
                                          extra_body={"prompt_logprobs": 0}).choices[0].model_extra[
        "prompt_logprobs"]) == engine(0)
    chunks = list(client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=2, temperature=0, stream=True,
                                            extra_body={"prompt_logprobs": 3}))
    firsts = [c.choices[0].model_extra.get("prompt_logprobs") for c in chunks if c.choices]
    assert seen(firsts[0]) == engine(3) and not any(firsts[1:])
    chat = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=2, temperature=1.0, n=2,
                                          extra_body={"prompt_logprobs": 1})  # (n > 1 samples: vLLM refuses greedy)
    offline_chat = offline.chat(MESSAGES, SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=1))[0]
    ids = offline_chat.prompt_token_ids
    want = [None if pos is None else {t: (round(lp.logprob, 4), lp.rank, lp.decoded_token) for t, lp in pos.items()
                                      if t == ids[i] or lp.rank <= 1}
            for i, pos in enumerate(offline_chat.prompt_logprobs)]
    assert seen(chat.model_extra["prompt_logprobs"]) == want and len(want) == chat.usage.prompt_tokens
    streamed = httpx.post(client.base_url.join("chat/completions").__str__(), json={
        "model": MODEL, "messages": MESSAGES, "stream": True, "prompt_logprobs": 1})
    assert streamed.status_code == 400 and streamed.json()["error"]["param"] == "prompt_logprobs"


def test_allowed_token_ids_and_truncate_prompt_tokens(client: Any, engine: AsyncLLM,  # noqa: F811
                                                      offline: LLM) -> None:  # noqa: F811
    """vLLM's ``allowed_token_ids`` (only those sampled) and ``truncate_prompt_tokens`` (the prompt's last k
    tokens, checked against the context after the cut) on both routes; bad values are a 400 naming them."""
    allowed = offline.get_tokenizer().encode(" yes no maybe", add_special_tokens=False)
    r = client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=6, temperature=1.0, seed=3,
                                  extra_body={"allowed_token_ids": allowed, "ignore_eos": True})
    assert r.choices[0].text and set(offline.get_tokenizer().encode(r.choices[0].text, add_special_tokens=False)) \
        <= set(allowed)
    limit = engine.limits().max_model_len
    long = list(range(1, 101)) * (limit // 100 + 1)  # past the context: the cut makes it fit
    cut = client.completions.create(model=MODEL, prompt=long, max_tokens=3, temperature=0,
                                    extra_body={"truncate_prompt_tokens": 9, "ignore_eos": True})
    want = offline.generate({"prompt_token_ids": long[-9:]}, SamplingParams(temperature=0, max_tokens=3,
                                                                             ignore_eos=True))[0]
    assert cut.usage.prompt_tokens == 9 and cut.choices[0].text == want.outputs[0].text
    chat = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=2,
                                          extra_body={"truncate_prompt_tokens": 4})
    assert chat.usage.prompt_tokens == 4
    for body, field in (({"allowed_token_ids": [engine.limits().vocab_size]}, "allowed_token_ids"),
                        ({"allowed_token_ids": []}, "allowed_token_ids"),
                        ({"truncate_prompt_tokens": 0}, "truncate_prompt_tokens")):
        bad = httpx.post(client.base_url.join("completions").__str__(),
                         json={"model": MODEL, "prompt": "hi", "max_tokens": 1, **body})
        assert bad.status_code == 400 and bad.json()["error"]["param"] == field, bad.text


def test_bad_words_as_offline(client: Any, offline: LLM) -> None:  # noqa: F811
    """vLLM's ``bad_words`` through the openai client: the completion the engine gives offline with them, and
    not the one it gives without."""
    greedy = dict(temperature=0.0, max_tokens=12, ignore_eos=True)
    plain = offline.generate(PROMPTS[0], SamplingParams(**greedy))[0].outputs[0]
    words = [offline.get_tokenizer().decode(plain.token_ids[:2])]
    want = offline.generate(PROMPTS[0], SamplingParams(**greedy, bad_words=words))[0].outputs[0].text
    got = client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=12, temperature=0,
                                    extra_body={"bad_words": words, "ignore_eos": True}).choices[0].text
    assert got == want != plain.text


def _ids(obj: Any, name: str) -> Any:
    return (obj.model_extra or {}).get(name)


def test_return_token_ids_gives_the_engines_ids_on_both_routes(client: Any, engine: AsyncLLM,
                                                                offline: LLM) -> None:  # noqa: F811
    """vLLM's ``return_token_ids``: completions put ``prompt_token_ids`` and ``token_ids`` in each choice, chat
    the prompt's in the response and the output's in each choice; streamed, the prompt's come once, in the
    first chunk (of each choice for completions, of the response for chat), and each chunk has its own ids,
    which together are the whole response's. Without the field none of them appear."""
    greedy = dict(temperature=0, max_tokens=7, extra_body={"return_token_ids": True, "ignore_eos": True})
    want = offline.generate(PROMPTS[0], SamplingParams(temperature=0, max_tokens=7, ignore_eos=True))[0]
    r = client.completions.create(model=MODEL, prompt=PROMPTS[0], **greedy)
    assert _ids(r.choices[0], "prompt_token_ids") == want.prompt_token_ids
    assert _ids(r.choices[0], "token_ids") == want.outputs[0].token_ids and len(want.outputs[0].token_ids) == 7
    chunks = [c.choices[0] for c in client.completions.create(model=MODEL, prompt=PROMPTS[0], stream=True, **greedy)
              if c.choices]
    assert _ids(chunks[0], "prompt_token_ids") == want.prompt_token_ids
    assert not any(_ids(c, "prompt_token_ids") for c in chunks[1:])
    assert [t for c in chunks for t in _ids(c, "token_ids")] == want.outputs[0].token_ids
    plain = client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=2)
    assert _ids(plain.choices[0], "token_ids") is None and _ids(plain.choices[0], "prompt_token_ids") is None

    chat_want = offline.chat(MESSAGES, SamplingParams(temperature=0, max_tokens=7, ignore_eos=True))[0]
    chat = client.chat.completions.create(model=MODEL, messages=MESSAGES, **greedy)
    assert _ids(chat, "prompt_token_ids") == chat_want.prompt_token_ids == \
        engine.chat_prompt(MESSAGES)["prompt_token_ids"]
    assert _ids(chat.choices[0], "token_ids") == chat_want.outputs[0].token_ids
    streamed = list(client.chat.completions.create(model=MODEL, messages=MESSAGES, stream=True, **greedy))
    assert _ids(streamed[0], "prompt_token_ids") == chat_want.prompt_token_ids
    assert not any(_ids(c, "prompt_token_ids") for c in streamed[1:])
    two = [c for c in client.chat.completions.create(model=MODEL, messages=MESSAGES, stream=True, n=2,
                                                     **{**greedy, "temperature": 1.0})
           if _ids(c, "prompt_token_ids")]  # as vLLM: in each choice's first (role) chunk
    assert sorted(c.choices[0].index for c in two) == [0, 1]
    assert all(_ids(c, "prompt_token_ids") == chat_want.prompt_token_ids and c.choices[0].delta.role for c in two)
    assert [t for c in streamed for ch in c.choices for t in (_ids(ch, "token_ids") or [])] == \
        chat_want.outputs[0].token_ids


def test_return_tokens_as_token_ids_names_logprobs_by_id(client: Any, engine: AsyncLLM) -> None:
    """vLLM's ``return_tokens_as_token_ids``: logprobs name each token (chosen and alternatives)
    ``token_id:{id}``, of the ids the response carries; the logprobs, completions' text offsets and chat's
    bytes stay those of the run without it."""
    kw = dict(model=MODEL, prompt=PROMPTS[1], max_tokens=6, temperature=0, logprobs=3)
    text = client.completions.create(**kw).choices[0].logprobs
    r = client.completions.create(**kw, extra_body={"return_tokens_as_token_ids": True, "return_token_ids": True})
    ids, lp = _ids(r.choices[0], "token_ids"), r.choices[0].logprobs
    assert lp.tokens == [f"token_id:{t}" for t in ids] != text.tokens
    assert lp.token_logprobs == text.token_logprobs and lp.text_offset == text.text_offset
    assert all(f"token_id:{t}" in top and all(k.startswith("token_id:") for k in top)
               for t, top in zip(ids, lp.top_logprobs))
    assert [sorted(top.values()) for top in lp.top_logprobs] == [sorted(top.values()) for top in text.top_logprobs]
    streamed = [c.choices[0].logprobs for c in client.completions.create(
        **kw, stream=True, extra_body={"return_tokens_as_token_ids": True}) if c.choices and c.choices[0].logprobs]
    assert [t for lp in streamed for t in lp.tokens] == lp.tokens

    chat_kw = dict(model=MODEL, messages=MESSAGES, max_tokens=5, temperature=0, logprobs=True, top_logprobs=2)
    plain = client.chat.completions.create(**chat_kw).choices[0].logprobs.content
    chat = client.chat.completions.create(**chat_kw, extra_body={"return_tokens_as_token_ids": True,
                                                                   "return_token_ids": True})
    ids, content = _ids(chat.choices[0], "token_ids"), chat.choices[0].logprobs.content
    assert [e.token for e in content] == [f"token_id:{t}" for t in ids]
    assert [(e.logprob, e.bytes) for e in content] == [(e.logprob, e.bytes) for e in plain]
    assert [e.bytes for e in content] == [list(engine.detokenize([t]).encode()) for t in ids]
    assert all(a.token.startswith("token_id:") for e in content for a in e.top_logprobs)
    streamed = [e.token for c in client.chat.completions.create(
        **chat_kw, stream=True, extra_body={"return_tokens_as_token_ids": True})
        for ch in c.choices if ch.logprobs for e in ch.logprobs.content]
    assert streamed == [e.token for e in content]


def test_the_servers_return_tokens_as_token_ids_is_a_default_a_request_overrides(engine: AsyncLLM) -> None:
    """``vtcore serve --return-tokens-as-token-ids`` (``build_app``'s ``return_tokens_as_token_ids``): ids where a
    request leaves the field out, text where it says false."""
    body = {"model": MODEL, "prompt": PROMPTS[0], "max_tokens": 3, "temperature": 0, "logprobs": 0}
    with ServerThread(build_app(engine, MODEL, None, 1 << 20, return_tokens_as_token_ids=True)) as srv:
        by_default = httpx.post(srv.url + "/v1/completions", json=body).json()["choices"][0]["logprobs"]["tokens"]
        as_text = httpx.post(srv.url + "/v1/completions", json={**body, "return_tokens_as_token_ids": False}
                             ).json()["choices"][0]["logprobs"]["tokens"]
    assert all(t.startswith("token_id:") for t in by_default) and len(by_default) == 3
    assert not any(t.startswith("token_id:") for t in as_text) and len(as_text) == 3


def test_cache_salt_keeps_prefix_hits_within_a_salt(server: ServerThread, client: Any, engine: AsyncLLM) -> None:
    """vLLM's ``cache_salt``: ``usage.prompt_tokens_details.cached_tokens`` counts only blocks cached by requests
    of the same salt, on both routes; an empty or non-string salt is a 400 naming it."""
    block = engine.limits().block_size
    ids = [(7 * i + 11) % 900 + 50 for i in range(3 * block + 2)]

    def cached(salt: str | None) -> int:
        extra = {} if salt is None else {"cache_salt": salt}
        r = client.completions.create(model=MODEL, prompt=ids, max_tokens=1, extra_body=extra)
        return r.usage.prompt_tokens_details.cached_tokens

    assert [cached(s) for s in ("red", "red", "blue", None, "blue")] == [0, 3 * block, 0, 0, 3 * block]
    chat = [client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=1,
                                           extra_body={"cache_salt": "green"}).usage for _ in range(2)]
    full = chat[1].prompt_tokens // block * block
    assert chat[0].prompt_tokens_details.cached_tokens == 0 < chat[1].prompt_tokens_details.cached_tokens
    assert chat[1].prompt_tokens_details.cached_tokens in (full, full - block)  # the last prompt token is computed
    for bad in ("", 5):
        r = httpx.post(server.url + "/v1/completions", json={"model": MODEL, "prompt": "hi", "cache_salt": bad})
        assert r.status_code == 400 and r.json()["error"]["param"] == "cache_salt", r.text


def test_priority_is_served_under_the_priority_policy_and_refused_otherwise(server: ServerThread,
                                                                            offline: LLM) -> None:  # noqa: F811
    """vLLM's ``priority``: a 400 naming it where the server schedules first come, first served (0 passes);
    under ``--scheduling-policy priority`` a prioritised request gets the tokens the engine gives offline."""
    body = {"model": MODEL, "prompt": PROMPTS[0], "max_tokens": 4, "temperature": 0, "ignore_eos": True}
    r = httpx.post(server.url + "/v1/completions", json={**body, "priority": 1})
    assert r.status_code == 400 and r.json()["error"]["param"] == "priority", r.text
    assert httpx.post(server.url + "/v1/completions", json={**body, "priority": 0}).status_code == 200
    want = offline.generate(PROMPTS[0], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))[0]
    engine = AsyncLLM(scheduling_policy="priority", device="cpu", num_kv_blocks=64)
    seen: list[int] = []
    add = engine.engine.add_request

    def recorded(rid: str, prompt: Any, params: SamplingParams, priority: int = 0) -> None:
        seen.append(priority)
        add(rid, prompt, params, priority)
    engine.engine.add_request = recorded
    try:
        with ServerThread(build_app(engine, MODEL, None, 1 << 20)) as srv:
            for rank in (-3, 7):
                r = httpx.post(srv.url + "/v1/completions", json={**body, "priority": rank})
                assert r.status_code == 200 and r.json()["choices"][0]["text"] == want.outputs[0].text, r.text
            assert seen == [-3, 7]  # the engine got each request's priority
            bad = httpx.post(srv.url + "/v1/chat/completions", json={"model": MODEL, "messages": MESSAGES,
                                                                      "priority": 1.5})
            assert bad.status_code == 400 and bad.json()["error"]["param"] == "priority"
    finally:
        engine.shutdown()
