"""The built-in loader for HF checkpoint folders: one model.safetensors or an indexed set of shards.

Files are memory-mapped (``safe_open``) and read one tensor at a time straight into the model's
preallocated parameters, so the checkpoint is never held in RAM beside the model.
"""
from __future__ import annotations

import json
import os

from torch import nn
from tqdm import tqdm

from vtcore.config import HFConfig
from vtcore.errors import CheckpointError
from vtcore.loading.weights import WeightMapper

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"


def checkpoint_files(model_path: str) -> list[str]:
    """The safetensors files of a checkpoint folder, checked to exist."""
    index = os.path.join(model_path, INDEX)
    if os.path.isfile(index):
        try:
            with open(index) as f:
                weight_map = json.load(f)["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError) as exc:
            raise CheckpointError(f"{index}: expected JSON with a 'weight_map' object ({exc})") from None
        if not isinstance(weight_map, dict) or not weight_map or not all(isinstance(v, str) for v in weight_map.values()):
            raise CheckpointError(f"{index}: weight_map is {str(weight_map)[:80]!r}, expected a non-empty object of "
                                  "tensor name -> shard file")
        files = [os.path.join(model_path, name) for name in sorted(set(weight_map.values()))]
    elif os.path.isfile(os.path.join(model_path, SINGLE)):
        files = [os.path.join(model_path, SINGLE)]
    else:
        raise CheckpointError(f"{model_path}: no {SINGLE} and no {INDEX}; expected HF safetensors weights "
                              "(or pass load_format='dummy' for random weights)")
    for path in files:
        if not os.path.isfile(path):
            raise CheckpointError(f"{path}: shard named in {INDEX} is missing")
    return files


def load_safetensors(model: nn.Module, model_path: str, hf_config: HFConfig, seed: int) -> None:
    """Fill ``model`` from the checkpoint's safetensors; every error names the file and tensor."""
    from safetensors import SafetensorError, safe_open

    from vtcore.layers.parallel import tp
    from vtcore.loading.lazy import LazySlice

    mapper = WeightMapper(model)
    files = checkpoint_files(model_path)
    seen: dict[str, str] = {}  # tensor name -> the file it came from
    with tqdm(desc="loading weights", unit="tensor", disable=None) as bar:
        for path in files:
            try:
                with safe_open(path, framework="pt", device="cpu") as f:
                    for name in f.keys():
                        if name in seen:  # which copy wins would depend on file order
                            raise CheckpointError(f"{model_path}: tensor {name!r} is in both "
                                                  f"{os.path.basename(seen[name])} and {os.path.basename(path)}; "
                                                  "expected one copy")
                        seen[name] = path
                        dtype = f.get_slice(name).get_dtype()
                        # under tensor parallelism a rank reads only its part of each tensor
                        read = (lambda: LazySlice(f.get_slice(name))) if tp().size > 1 else (lambda: f.get_tensor(name))
                        mapper.load(path, name, dtype, read)
                        bar.update()
            except SafetensorError as exc:
                raise CheckpointError(f"{path}: truncated or corrupt safetensors file ({exc})") from None
            except OSError as exc:
                raise CheckpointError(f"{path}: cannot read ({exc})") from None
    missing = list(mapper.missing())
    if missing:
        shown = ", ".join(repr(m) for m in missing[:5]) + (f" and {len(missing) - 5} more" if len(missing) > 5 else "")
        raise CheckpointError(f"{model_path}: missing tensor {shown} (not found in {', '.join(map(os.path.basename, files))})")
