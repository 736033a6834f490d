"""A model argument: a checkpoint folder as it is, else a Hugging Face hub id, through huggingface_hub's cache."""
from __future__ import annotations

import os
from typing import TYPE_CHECKING

from vtcore.config import missing_checkpoint
from vtcore.errors import ModelNotFoundError

if TYPE_CHECKING:
    from huggingface_hub.errors import LocalEntryNotFoundError

#: what the engine reads of a hub repository besides its weights: config.json and generation_config.json,
#: the tokenizer's files (tokenizer.json, vocab.json, merges.txt, tokenizer.model, *.tiktoken), chat templates
CONFIG_PATTERNS = ("*.json", "*.txt", "*.model", "*.tiktoken", "*.jinja")
WEIGHT_PATTERNS = ("*.safetensors",)
#: a tokenizer's own code (``auto_map``), fetched only where remote code is trusted
CODE_PATTERNS = ("*.py",)


def resolve_model(model: str, *, weights: bool = True, code: bool = False) -> str:
    """The checkpoint folder of ``model``: an existing folder unchanged; else ``model`` as a hub id, its
    snapshot folder in huggingface_hub's cache, downloaded there unless ``HF_HUB_OFFLINE`` is set (with
    ``weights=False``, without the safetensors files: dummy weights, a tokenizer; with ``code``, also its
    Python files: a tokenizer's own class, under ``trust_remote_code``).

    A ``model`` that is no folder and no valid hub id raises the folder error (FileNotFoundError); a hub
    id that cannot be had raises ModelNotFoundError saying why and how to get it.
    """
    if os.path.isdir(model):
        return model
    from huggingface_hub import constants, snapshot_download
    from huggingface_hub.errors import (GatedRepoError, HFValidationError, LocalEntryNotFoundError,
                                        RepositoryNotFoundError)
    from huggingface_hub.utils import validate_repo_id

    try:
        validate_repo_id(model)
    except HFValidationError:
        raise missing_checkpoint(model) from None
    offline = constants.HF_HUB_OFFLINE  # read at each call, not at import: it may have changed since
    patterns = [*CONFIG_PATTERNS, *(WEIGHT_PATTERNS if weights else ()), *(CODE_PATTERNS if code else ())]
    try:
        return snapshot_download(model, allow_patterns=patterns, local_files_only=offline)
    except LocalEntryNotFoundError as exc:
        raise ModelNotFoundError(_not_cached(model, offline, exc)) from None
    except GatedRepoError:
        raise ModelNotFoundError(f"model={model!r}: no such folder, and the Hugging Face hub model {model!r} is "
                                 f"gated: accept its terms on https://huggingface.co/{model} and log in "
                                 "(`hf auth login`), or pass a checkpoint folder") from None
    except RepositoryNotFoundError:
        raise ModelNotFoundError(f"model={model!r}: no such folder, and the Hugging Face hub has no model "
                                 f"{model!r} (or it is private: log in with `hf auth login`); pass a checkpoint "
                                 "folder or a hub id such as Qwen/Qwen3-0.6B") from None


def _not_cached(model: str, offline: bool, exc: LocalEntryNotFoundError) -> str:
    """The message for a hub id that is not in the cache and could not be downloaded."""
    from huggingface_hub import constants

    cause = exc.__cause__
    detail = f"{type(cause).__name__}: {cause}" if cause is not None else str(exc).splitlines()[0]
    why = "HF_HUB_OFFLINE is set" if offline else f"the hub could not be reached ({detail})"
    return (f"model={model!r}: no such folder, and the Hugging Face hub id {model!r} is not in the cache "
            f"({constants.HF_HUB_CACHE}); {why}. Get it with `hf download {model}` where the hub "
            "is reachable (same HF_HOME / HF_HUB_CACHE), or pass a checkpoint folder")
