"""Loading a checkpoint's tokenizer (transformers' AutoTokenizer, imported only when needed)."""
from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from vtcore.config import EngineConfig

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


def load_tokenizer(path: str, trust_remote_code: bool = False) -> Any | None:
    """The tokenizer stored in ``path``, or None when the folder has none (token-id prompts only);
    ``trust_remote_code``: transformers' (a tokenizer class the checkpoint ships may run)."""
    if not any(os.path.isfile(os.path.join(path, f)) for f in TOKENIZER_FILES):
        return None
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code)


def engine_tokenizer(config: EngineConfig, model_path: str) -> Any | None:
    """The engine's tokenizer: ``config.tokenizer``'s (a folder or hub id) where given, else the model's, at
    ``model_path`` (resolved; under ``trust_remote_code`` a hub id is resolved again with its code files)."""
    from vtcore.loading.hub import resolve_model

    code = config.trust_remote_code
    if config.tokenizer or code:
        model_path = resolve_model(config.tokenizer or config.model, weights=False, code=code)
    return load_tokenizer(model_path, code)
