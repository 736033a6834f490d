"""The chat template and its switches as vLLM takes them: ``LLM.chat(chat_template=, add_generation_prompt=,
continue_final_message=, tools=, chat_template_kwargs=)``, the same fields of ``/v1/chat/completions`` and
``/tokenize``, and ``vtcore serve --chat-template`` (a file or the template itself)."""
from __future__ import annotations

from typing import Any, Iterator

import openai
import pytest
from server_harness import MAX_BYTES, MODEL, ServerThread, engine, error_of, greedy, httpx, needs_default_model, \
    offline  # noqa: F401

from vtcore import LLM, AsyncLLM
from vtcore.server.app import build_app
from vtcore.server.chat import load_chat_template

pytestmark = needs_default_model

#: a template unlike the tokenizer's, which shows the variables it was given
TEMPLATE = ("{% for m in messages %}[{{ m.role }}] {{ m.content }}\n{% endfor %}"
            "{% if tools %}(tools: {{ tools | map(attribute='function.name') | join(',') }})\n{% endif %}"
            "{% if add_generation_prompt %}[assistant]{% endif %}{{ mood | default('') }}")
ASKED = [{"role": "user", "content": "A quote?"}]
STARTED = ASKED + [{"role": "assistant", "content": "Once upon"}]
TOOL = {"type": "function", "function": {"name": "lookup", "parameters": {"type": "object", "properties": {}}}}


def test_llm_chat_takes_vllms_template_arguments(offline: LLM) -> None:  # noqa: F811
    tok = offline.get_tokenizer()
    on = offline.chat_prompt(STARTED, add_generation_prompt=False, continue_final_message=True)["prompt"]
    assert on.endswith("<|im_start|>assistant\nOnce upon")  # the final message left open
    assert offline.chat_prompt(ASKED)["prompt"].endswith("<|im_start|>assistant\n")
    got = offline.chat(STARTED, greedy(6), add_generation_prompt=False, continue_final_message=True)[0]
    assert got.prompt == on and got.outputs[0].token_ids == offline.generate(on, greedy(6))[0].outputs[0].token_ids
    custom = offline.chat(ASKED, greedy(2), chat_template=TEMPLATE, tools=[TOOL],
                          chat_template_kwargs={"mood": "calm"})[0]
    assert custom.prompt == "[user] A quote?\n(tools: lookup)\n[assistant]calm"
    assert custom.prompt_token_ids == tok.encode(custom.prompt, add_special_tokens=False)
    with pytest.raises(ValueError, match="add_generation_prompt=True and continue_final_message=True"):
        offline.chat(STARTED, continue_final_message=True)
    # a message the template cannot take is named, not left to fail inside Jinja
    with pytest.raises(ValueError, match=r"^messages\[1\]=\{'content': 'x'\}: expected a dict with a 'role'"):
        offline.chat([ASKED[0], {"content": "x"}])
    with pytest.raises(ValueError, match=r"^messages\[0\]='hi': expected a dict"):
        offline.chat_prompt(["hi"])
    with pytest.raises(ValueError, match=r"^messages=\[\]: expected a non-empty list"):
        offline.chat([])  # (one empty conversation, not none)
    with pytest.raises(ValueError, match=r"^messages='hello': expected a non-empty list"):
        offline.chat("hello")  # (named whole, not as its first letter)
    assert offline.chat_prompt(tuple(ASKED)) == offline.chat_prompt(ASKED)


@pytest.fixture(scope="module")
def templated(engine: AsyncLLM) -> Iterator[ServerThread]:  # noqa: F811
    with ServerThread(build_app(engine, MODEL, None, MAX_BYTES, chat_template=TEMPLATE)) as srv:
        yield srv


def test_the_server_renders_the_served_template_and_the_switches(templated: ServerThread,
                                                                  offline: LLM) -> None:  # noqa: F811
    with openai.OpenAI(base_url=templated.url + "/v1", api_key="unused", max_retries=0, timeout=60) as client:
        r = client.chat.completions.create(model=MODEL, messages=STARTED, max_tokens=5, temperature=0,
                                           extra_body={"add_generation_prompt": False, "continue_final_message": True,
                                                       "ignore_eos": True})
    want = offline.chat(STARTED, greedy(5, ignore_eos=True), chat_template=TEMPLATE, add_generation_prompt=False,
                        continue_final_message=True)[0]
    assert want.prompt == "[user] A quote?\n[assistant] Once upon"  # open: no newline after it
    assert r.usage.prompt_tokens == len(want.prompt_token_ids) and r.choices[0].message.content == want.outputs[0].text
    t = httpx.post(templated.url + "/tokenize", json={"messages": ASKED, "add_generation_prompt": False}).json()
    assert t["tokens"] == offline.chat_prompt(ASKED, chat_template=TEMPLATE, add_generation_prompt=False)[
        "prompt_token_ids"]


@pytest.mark.parametrize("path, body, reason", [
    ("/v1/chat/completions", {"messages": STARTED, "continue_final_message": True}, "at most one"),
    ("/tokenize", {"messages": STARTED, "continue_final_message": True}, "at most one"),
    ("/tokenize", {"prompt": "Once upon", "continue_final_message": True}, "at most one"),  # as its document says
])
def test_switches_that_contradict_are_a_400_naming_the_field(templated: ServerThread, path: str, body: dict,
                                                              reason: str) -> None:
    r = httpx.post(templated.url + path, json={"model": MODEL, "max_tokens": 2, **body})
    err = r.json()["error"]
    assert r.status_code == 400 and err["param"] == "continue_final_message" and reason in err["message"], r.text


def test_chat_template_is_a_file_or_the_template_and_a_bad_one_fails_before_serving(tmp_path: Any) -> None:
    f = tmp_path / "t.jinja"
    f.write_text(TEMPLATE)
    assert load_chat_template(str(f)) == TEMPLATE == load_chat_template(TEMPLATE)
    with pytest.raises(ValueError, match=r"'/no/such.jinja': no such file, and not a Jinja template"):
        load_chat_template("/no/such.jinja")
    f.write_text("{% for m in messages %}\n{{ m.content }")
    with pytest.raises(ValueError, match=rf"--chat-template: {f}, line 2: "):
        load_chat_template(str(f))
