"""A model argument that is no folder is a Hugging Face hub id, found through huggingface_hub's cache.

The cache here is a fake one in tmp_path, laid out as huggingface_hub lays it out
(``models--acme--tiny/snapshots/<commit>/`` and ``refs/main``), with ``HF_HUB_OFFLINE`` set: nothing
is downloaded.
"""
from __future__ import annotations

import io
import os
import shutil
from pathlib import Path

import huggingface_hub
import pytest
from huggingface_hub import constants
from huggingface_hub.errors import GatedRepoError, LocalEntryNotFoundError, RepositoryNotFoundError

from vtcore import LLM, SamplingParams
from vtcore.cli.main import main
from vtcore.engine import async_llm
from vtcore.errors import ModelNotFoundError
from vtcore.loading.hub import resolve_model

COMMIT = "0123456789abcdef0123456789abcdef01234567"
GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
KNOBS = dict(device="cpu", max_model_len=64, num_kv_blocks=4)


def _hint(model: str) -> str:
    return (f"Get it with `hf download {model}` where the hub is reachable (same HF_HOME / HF_HUB_CACHE), or "
            "pass a checkpoint folder")


@pytest.fixture
def no_hub(monkeypatch: pytest.MonkeyPatch) -> None:
    """snapshot_download fails the test if called."""
    monkeypatch.setattr(huggingface_hub, "snapshot_download", lambda *a, **kw: pytest.fail("the hub was asked"))


@pytest.fixture
def hub_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, tiny_checkpoint) -> Path:
    """An offline cache holding ``acme/tiny`` (the tiny checkpoint); returns the cache folder."""
    cache = tmp_path / "hub"
    repo = cache / "models--acme--tiny"
    shutil.copytree(tiny_checkpoint[0], repo / "snapshots" / COMMIT)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(COMMIT)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    return cache


def test_a_folder_is_itself_without_the_hub(tmp_path: Path, no_hub, monkeypatch) -> None:
    assert resolve_model(str(tmp_path)) == str(tmp_path)
    monkeypatch.chdir(tmp_path.parent)
    assert resolve_model(tmp_path.name) == tmp_path.name  # a relative folder, though a valid hub id too


@pytest.mark.parametrize("model", ["./x", "/nowhere/x"])
def test_no_folder_and_no_hub_id_keeps_the_folder_error(model: str, no_hub, tmp_path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    with pytest.raises(FileNotFoundError) as exc:
        resolve_model(model)
    assert str(exc.value) == f"model={model!r}: expected a checkpoint folder with config.json, found none"


def test_a_hub_id_in_the_offline_cache_serves_as_its_folder(hub_cache: Path, tiny_checkpoint) -> None:
    snapshot = hub_cache / "models--acme--tiny" / "snapshots" / COMMIT
    assert os.path.realpath(resolve_model("acme/tiny")) == os.path.realpath(snapshot)
    by_id = LLM("acme/tiny", **KNOBS)
    assert by_id.model == "acme/tiny"  # as given (the server's /v1/models root)
    assert os.path.realpath(by_id.engine.model_path) == os.path.realpath(snapshot)
    prompts = [{"prompt_token_ids": [1, 2, 3]}, {"prompt_token_ids": [7, 5]}]
    want = [o.outputs[0].token_ids for o in LLM(tiny_checkpoint[0], **KNOBS).generate(prompts, GREEDY)]
    assert [o.outputs[0].token_ids for o in by_id.generate(prompts, GREEDY)] == want


def test_bench_resolves_a_hub_id_before_reading_its_config(hub_cache: Path, monkeypatch) -> None:
    """bench reads config.json itself (max_model_len) and hands the HF peer a folder: the snapshot's."""
    def built(**config):
        raise RuntimeError(f"engine not started: {config['model']}")

    monkeypatch.setattr(async_llm, "AsyncLLM", built)
    with pytest.raises(RuntimeError, match="engine not started: ") as exc:
        main(["bench", "--model", "acme/tiny", "--device", "cpu", "--copy-mib", "1", "--output-len", "8"],
             out=io.StringIO())
    assert os.path.realpath(str(exc.value).split(": ", 1)[1]) == \
        os.path.realpath(hub_cache / "models--acme--tiny" / "snapshots" / COMMIT)


def test_a_hub_id_not_in_the_offline_cache(hub_cache: Path, capsys) -> None:
    text = (f"model='acme/x': no such folder, and the Hugging Face hub id 'acme/x' is not in the cache ({hub_cache}); "
            f"HF_HUB_OFFLINE is set. {_hint('acme/x')}")
    with pytest.raises(ModelNotFoundError) as exc:
        resolve_model("acme/x")
    assert str(exc.value) == text and isinstance(exc.value, FileNotFoundError)
    assert main(["generate", "--model", "acme/x", "--device", "cpu", "Hello"], out=io.StringIO()) == 2
    assert capsys.readouterr().err == f"vtcore generate: error: {text}\n"


def test_an_unreachable_hub(tmp_path: Path, monkeypatch) -> None:
    calls = []

    def unreachable(repo_id: str, **kw) -> str:
        calls.append(kw)
        try:
            raise ConnectionError("no route to host")
        except ConnectionError as cause:
            raise LocalEntryNotFoundError("An error happened while trying to locate the files on the Hub") from cause

    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(huggingface_hub, "snapshot_download", unreachable)
    with pytest.raises(ModelNotFoundError) as exc:
        resolve_model("acme/x")
    assert str(exc.value) == (f"model='acme/x': no such folder, and the Hugging Face hub id 'acme/x' is not in the "
                              f"cache ({tmp_path}); the hub could not be reached (ConnectionError: no route to host). "
                              f"{_hint('acme/x')}")
    with pytest.raises(ModelNotFoundError):
        resolve_model("acme/x", weights=False)
    assert [kw["local_files_only"] for kw in calls] == [False, False]
    # config, generation config and tokenizer files always; the safetensors only when weights load
    assert "*.safetensors" in calls[0]["allow_patterns"] and "*.safetensors" not in calls[1]["allow_patterns"]
    assert {"*.json", "*.jinja", "*.txt", "*.model", "*.tiktoken"} <= set(calls[1]["allow_patterns"])


@pytest.mark.parametrize("error, text", [
    (RepositoryNotFoundError, "the Hugging Face hub has no model 'acme/x' (or it is private: log in with "
                              "`hf auth login`)"),
    (GatedRepoError, "the Hugging Face hub model 'acme/x' is gated: accept its terms on https://huggingface.co/acme/x"),
])
def test_a_repository_the_hub_refuses(error: type, text: str, monkeypatch) -> None:
    import httpx

    def refused(repo_id: str, **kw) -> str:
        raise error("refused", response=httpx.Response(404, request=httpx.Request("GET", "https://huggingface.co")))

    monkeypatch.setattr(huggingface_hub, "snapshot_download", refused)
    with pytest.raises(ModelNotFoundError) as exc:
        resolve_model("acme/x")
    assert str(exc.value).startswith(f"model='acme/x': no such folder, and {text}")
