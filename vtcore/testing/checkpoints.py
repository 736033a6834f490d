"""Editing checkpoint folders in tests: copy one and change its tensors."""
from __future__ import annotations

import os
import shutil
from typing import Callable

import torch


def edited_copy(src: str, dst: str, edit: Callable[[dict[str, torch.Tensor]], None]) -> str:
    """Copy the folder ``src`` to ``dst`` and apply ``edit`` to the tensors of its model.safetensors."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst)
    path = os.path.join(dst, "model.safetensors")
    tensors = load_file(path)
    edit(tensors)
    save_file(tensors, path, metadata={"format": "pt"})
    return dst
