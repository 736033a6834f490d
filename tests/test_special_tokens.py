"""A text prompt is encoded with the tokenizer's special tokens, as ``tokenizer(text)`` and vLLM do (a BOS
where the tokenizer adds one), offline and in ``/v1/completions`` and ``/tokenize``, unless
``add_special_tokens`` is false; a conversation's special tokens are its chat template's alone."""
from __future__ import annotations

import json
import os
import shutil
from typing import Any, Iterator

import pytest
from server_harness import KNOBS, MODEL, ServerThread, httpx, needs_default_model

from vtcore import LLM, AsyncLLM, SamplingParams
from vtcore.config import DEFAULT_MODEL
from vtcore.server.app import build_app

pytestmark = needs_default_model
BOS = "<|endoftext|>"  # the embedded tokenizer's id 0, made its BOS here
TEXT = "The meaning of life is"
MESSAGES = [{"role": "user", "content": "A quote?"}]
GREEDY = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)


@pytest.fixture(scope="module")
def bos_model(tmp_path_factory: pytest.TempPathFactory) -> str:
    """The embedded default model whose tokenizer puts a BOS before every text it encodes with specials."""
    path = str(tmp_path_factory.mktemp("bos_model"))
    for name in os.listdir(DEFAULT_MODEL):
        if name != "model.safetensors":
            shutil.copy(os.path.join(DEFAULT_MODEL, name), path)
    os.symlink(os.path.join(DEFAULT_MODEL, "model.safetensors"), os.path.join(path, "model.safetensors"))
    with open(os.path.join(path, "tokenizer.json")) as f:
        spec = json.load(f)
    spec["post_processor"] = {"type": "Sequence", "processors": [spec["post_processor"], {
        "type": "TemplateProcessing", "single": [{"SpecialToken": {"id": BOS, "type_id": 0}},
                                                 {"Sequence": {"id": "A", "type_id": 0}}],
        "pair": [{"Sequence": {"id": "A", "type_id": 0}}, {"Sequence": {"id": "B", "type_id": 1}}],
        "special_tokens": {BOS: {"id": BOS, "ids": [0], "tokens": [BOS]}}}]}
    with open(os.path.join(path, "tokenizer.json"), "w") as f:
        json.dump(spec, f)
    return path


@pytest.fixture(scope="module")
def bos_server(bos_model: str) -> Iterator[tuple[ServerThread, AsyncLLM]]:
    engine = AsyncLLM(bos_model, **KNOBS)
    with ServerThread(build_app(engine, MODEL, None, 1 << 20)) as srv:
        yield srv, engine
    engine.shutdown()


def test_offline_text_prompts_get_the_tokenizers_bos(bos_model: str) -> None:
    from transformers import AutoTokenizer

    want = AutoTokenizer.from_pretrained(bos_model)(TEXT).input_ids
    assert want[0] == 0 and want[1:] == AutoTokenizer.from_pretrained(bos_model).encode(TEXT, add_special_tokens=False)
    llm = LLM(bos_model, **KNOBS)
    out = llm.generate(TEXT, GREEDY)[0]
    assert out.prompt_token_ids == want
    assert out.outputs[0].token_ids == llm.generate({"prompt_token_ids": want}, GREEDY)[0].outputs[0].token_ids
    chat = llm.chat(MESSAGES, GREEDY)[0]
    assert chat.prompt_token_ids == llm.engine.chat_prompt(MESSAGES)["prompt_token_ids"]
    assert chat.prompt_token_ids[0] != 0  # the template's tokens only


def _post(srv: ServerThread, path: str, body: dict[str, Any]) -> Any:
    r = httpx.post(srv.url + path, json=body)
    assert r.status_code == 200, r.text
    return r.json()


def test_completions_and_tokenize_add_the_bos_unless_asked_not_to(bos_server: tuple[ServerThread, AsyncLLM]) -> None:
    srv, engine = bos_server
    with_bos = engine.tokenize(TEXT)[1]
    assert with_bos[0] == 0 and engine.tokenize(TEXT, add_special_tokens=False)[1] == with_bos[1:]
    assert _post(srv, "/tokenize", {"prompt": TEXT})["tokens"] == with_bos
    assert _post(srv, "/tokenize", {"prompt": TEXT, "add_special_tokens": False})["tokens"] == with_bos[1:]
    chat_ids = engine.chat_prompt(MESSAGES)["prompt_token_ids"]
    assert _post(srv, "/tokenize", {"messages": MESSAGES})["tokens"] == chat_ids and chat_ids[0] != 0
    body = {"model": MODEL, "prompt": TEXT, "max_tokens": 4, "temperature": 0, "ignore_eos": True,
            "return_token_ids": True}
    got = _post(srv, "/v1/completions", body)["choices"][0]
    assert got["prompt_token_ids"] == with_bos
    assert got["token_ids"] == _post(srv, "/v1/completions", {**body, "prompt": with_bos})["choices"][0]["token_ids"]
    plain = _post(srv, "/v1/completions", {**body, "add_special_tokens": False})
    assert plain["usage"]["prompt_tokens"] == len(with_bos) - 1
    chat = _post(srv, "/v1/chat/completions", {"model": MODEL, "messages": MESSAGES, "max_tokens": 1})
    assert chat["usage"]["prompt_tokens"] == len(chat_ids)
