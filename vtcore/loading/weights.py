"""Mapping checkpoint tensor names onto a model's (possibly fused) parameters, with coverage checks."""
from __future__ import annotations

from typing import Iterator

import torch
from torch import nn

from vtcore.errors import CheckpointError
from vtcore.layers.parallel import materialize

#: safetensors dtype tags a float weight may be stored in.
FLOAT_DTYPES = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}
#: safetensors dtype tags of the packed formats' tensors (parameters marked ``exact_dtype``).
EXACT_DTYPES = {"U8": torch.uint8, "F8_E4M3": torch.float8_e4m3fn, "F32": torch.float32, "I32": torch.int32}


class WeightMapper:
    """Resolves checkpoint names to (parameter, shard) and records which tensor filled each shard."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self.params = dict(model.named_parameters())
        self.packed: dict[str, tuple[str, str]] = getattr(model, "packed_modules_mapping", {})
        self.skipped: tuple[str, ...] = getattr(model, "skipped_tensors", ())
        self.loaded: dict[str, dict[str | None, str]] = {name: {} for name in self.params}  # shard -> tensor

    def target(self, name: str) -> tuple[str, str | None] | None:
        """(parameter name, shard) for a checkpoint tensor; None when the model skips it."""
        rename = getattr(self.model, "checkpoint_name", None)
        if rename is not None:
            name = rename(name)
            if name is None or isinstance(name, tuple):
                return name  # skipped, or already (parameter, shard)
        if name in self.skipped:
            return None
        parts = name.split(".")
        for i, part in enumerate(parts):
            if part in self.packed:
                fused, shard = self.packed[part]
                return ".".join(parts[:i] + [fused] + parts[i + 1:]), shard
        return name, None

    def load(self, file: str, name: str, dtype_tag: str, read: "callable") -> None:
        """Load checkpoint tensor ``name`` (read lazily by ``read()``) into its parameter slice."""
        target = self.target(name)
        if target is None:
            return
        pname, shard = target
        if pname not in self.params:
            raise CheckpointError(f"{file}: unexpected tensor {name!r}: {type(self.model).__name__} "
                                  f"has no parameter {pname!r}")
        param = self.params[pname]
        first = self.loaded[pname].get(shard)
        if first is not None:  # (a wrong mapping: two tensors into one place, and another place left unfilled)
            raise CheckpointError(f"{file}: tensor {name!r} loads into parameter {pname!r}"
                                  + (f" shard {shard!r}" if shard else "") + f", which tensor {first!r} already "
                                  "filled; expected one tensor a parameter (shard): check the model's "
                                  "packed_modules_mapping (or checkpoint_name)")
        if getattr(param, "exact_dtype", False):
            if EXACT_DTYPES.get(dtype_tag) != param.dtype:
                raise CheckpointError(f"{file}: tensor {name!r} has dtype {dtype_tag}, expected "
                                      f"{str(param.dtype).removeprefix('torch.')} for parameter {pname!r}")
        elif param.dtype.is_floating_point and dtype_tag not in FLOAT_DTYPES:
            raise CheckpointError(f"{file}: tensor {name!r} has unsupported dtype {dtype_tag}, "
                                  f"expected one of {sorted(FLOAT_DTYPES)}")
        try:
            tensor = read() if getattr(param, "exact_dtype", False) else read().to(param.dtype)
            param.weight_loader(param, tensor, shard) if hasattr(param, "weight_loader") else _copy(param, tensor)
        except ValueError as exc:
            raise CheckpointError(f"{file}: tensor {name!r} has {exc} for parameter {pname!r}"
                                  + (f" shard {shard!r}" if shard else "")) from None
        self.loaded[pname][shard] = name

    def missing(self) -> Iterator[str]:
        """Checkpoint names of every parameter (shard) that no tensor filled: the model's
        ``checkpoint_name_for(param, shard)`` where it gives one (a model that renames tensors with
        ``checkpoint_name`` inverts it there), else the parameter's name with fusing undone."""
        own_name = getattr(self.model, "checkpoint_name_for", lambda p, s: None)
        for pname, param in self.params.items():
            if None in self.loaded[pname]:
                continue  # a whole tensor loaded at once covers every shard
            for shard in getattr(param, "shards", (None,)):
                if shard not in self.loaded[pname]:
                    yield own_name(pname, shard) or unfused_name(pname, shard, self.packed)


def unfused_name(pname: str, shard: str | None, packed: dict[str, tuple[str, str]]) -> str:
    """The name shard ``shard`` of fused parameter ``pname`` has in a checkpoint, by the model's
    ``packed_modules_mapping`` (``layers.0.qkv_proj.weight`` shard ``k`` -> ``layers.0.k_proj.weight``)."""
    if shard is None:
        return pname
    reverse = {(fused, s): part for part, (fused, s) in packed.items()}
    parts = pname.split(".")
    i = next((i for i, p in enumerate(parts) if (p, shard) in reverse), None)
    return f"{pname} shard {shard}" if i is None else ".".join(parts[:i] + [reverse[(parts[i], shard)]] + parts[i + 1:])


def _copy(param: nn.Parameter, loaded: torch.Tensor) -> None:
    if tuple(param.shape) != tuple(loaded.shape):
        raise ValueError(f"shape {tuple(loaded.shape)}, expected {tuple(param.shape)}")
    param.data.copy_(materialize(loaded))
