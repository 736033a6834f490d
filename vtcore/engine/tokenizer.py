"""Loading a checkpoint's tokenizer (transformers' AutoTokenizer, imported only when needed)."""
from __future__ import annotations

import os
from typing import Any

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


def load_tokenizer(path: str) -> Any | None:
    """The tokenizer stored in ``path``, or None when the folder has none (token-id prompts only)."""
    if not any(os.path.isfile(os.path.join(path, f)) for f in TOKENIZER_FILES):
        return None
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)
