"""Linear layers whose weights may be fused from several checkpoint tensors (q/k/v, gate/up).

A fused layer names its shards (``("q", 2048), ("k", 512), ("v", 512)``); the loader calls
``weight_loader(param, tensor, shard)`` once per checkpoint tensor and each shard lands in its
row slice (or, for a parameter marked ``per_shard``, such as a quantized layer's global scales,
its shard's own entry). The loader uses ``param.shards`` to check that every shard arrived.
A quant method may take a Linear over (:mod:`vtcore.layers.quantized`): ``weight`` is replaced by the
method's tensors and ``self.quant``'s ``apply`` computes the layer (at decode sizes its
``gemv_weight``, when not None, feeds the Triton GEMV instead).

Under tensor parallelism (:mod:`vtcore.layers.parallel`) a ``parallel="column"`` Linear holds its
rank's rows of each shard (``parts``: a shard split into other than one part per rank, such as key/value
heads replicated over ranks), a ``parallel="row"`` one its columns, its output summed over the ranks;
the loader hands it whole checkpoint tensors and ``weight_loader`` keeps the rank's part.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Callable

import torch
from torch import nn
from torch.nn import functional as F

from vtcore.layers import parallel as tp
from vtcore.layers.activation import silu_and_mul
from vtcore.layers.quantized import QuantSlot, QuantTarget
from vtcore.quant.base import QuantTensor, WeightSpec

if TYPE_CHECKING:
    from vtcore.kernels.rope import QKRope


GEMV_MAX_ROWS = 16  # up to this many rows, CUDA runs vtcore.kernels.gemv instead of cuBLAS
PROLOGUE_MAX_ROWS = 1  # up to this many rows, the GEMV also computes the op feeding it (norm, SwiGLU)


class Linear(nn.Module, QuantTarget):
    """``y = x W^T (+ b)`` with an optional split of the output rows into named shards."""

    tp_sharded = True  # (``parallel``) see vtcore.layers.parallel

    def __init__(self, in_features: int, out_features: int | list[tuple[str, int]], bias: bool = False,
                 parallel: str | None = None, parts: dict[str, tuple[int, int]] | None = None,
                 segments: dict[str, list[int]] | None = None) -> None:
        """``out_features``: whole sizes (a shard's, or the layer's); ``parallel`` / ``parts``: see the module
        docstring (``parts``: shard -> (this rank's part, parts), default (rank, size)); ``segments``: a
        column-parallel shard made of consecutive blocks each split over the ranks (Gated DeltaNet's
        [q | k | v] rows), shard -> the blocks' whole lengths."""
        super().__init__()
        shards = out_features if isinstance(out_features, list) else []
        if parallel not in (None, "column", "row"):
            raise ValueError(f"Linear parallel={parallel!r}: expected None, 'column' or 'row'")
        self.tp_group = group = tp.tp()
        self.parallel = parallel if group.collective else None
        self.reduce_bias = self.parallel != "row" or group.rank == 0  # a row-parallel bias is added once
        #: shard (None: the whole layer) -> (whole rows, this rank's part, parts) of a column-parallel layer
        self.column_parts: dict[str | None, tuple[int, int, int]] = {}
        self.segments = segments or {}
        if self.parallel == "column":
            for name, size in shards or [(None, int(out_features))]:
                part, count = (parts or {}).get(name, (group.rank, group.size))
                if size % count:
                    raise ValueError(f"tensor_parallel_size={group.size} does not divide {name or 'the'} rows "
                                     f"({size}) into {count} parts")
                self.column_parts[name] = (size, part, count)
            shards = [(name, size // self.column_parts[name][2]) for name, size in shards]
            out_features = out_features if shards else int(out_features) // self.column_parts[None][2]
        if self.parallel == "row":
            in_features = tp.split(in_features, "a row-parallel layer's in_features")
        self.in_features = in_features
        self.out_features = sum(n for _, n in shards) if shards else int(out_features)
        self.shard_slices: dict[str, slice] = {}
        start = 0
        for name, size in shards:
            self.shard_slices[name] = slice(start, start + size)
            start += size
        self.weight = self.new_param(torch.empty(self.out_features, in_features))
        self.bias = self.new_param(torch.empty(self.out_features)) if bias else None
        self.quant = None

    @property
    def shard_names(self) -> list[str | None]:
        return list(self.shard_slices) or [None]

    def new_param(self, data: torch.Tensor, per_shard: bool = False, exact_dtype: bool = False) -> nn.Parameter:
        """A parameter loaded by shard rows (or, ``per_shard``, one entry per shard)."""
        return loadable_param(data, tuple(self.shard_slices) or (None,), self.weight_loader, per_shard, exact_dtype)

    def shard_view(self, param: nn.Parameter, shard: str | None) -> torch.Tensor:
        """The part of ``param`` that checkpoint shard ``shard`` fills (all of it for None)."""
        if shard is None:
            return param.data
        if getattr(param, "per_shard", False):
            i = list(self.shard_slices).index(shard)
            return param.data[i:i + 1]
        return param.data[self.shard_slices[shard]]

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard: str | None = None) -> None:
        """Copy one checkpoint tensor into ``param`` (its shard's rows when ``shard`` is given; under tensor
        parallelism the rank's part of it)."""
        copy_checked(self.shard_view(param, shard), self._rank_part(param, loaded, shard))

    def _rank_part(self, param: nn.Parameter, loaded: torch.Tensor, shard: str | None) -> torch.Tensor:
        if self.parallel is None or getattr(param, "per_shard", False):
            return loaded
        if self.parallel == "row":  # a bias is whole
            return loaded if loaded.dim() == 1 else tp.rank_part(loaded, 1, self.tp_group)
        if shard is None and self.shard_slices:  # a fused tensor whole: each shard's part
            whole = [self.column_parts[name][0] for name in self.shard_slices]
            return torch.cat([tp.materialize(self._column_part(t, name))
                              for t, name in zip(loaded.split(whole), self.shard_slices)])
        return self._column_part(loaded, shard)

    def _column_part(self, loaded: torch.Tensor, shard: str | None) -> torch.Tensor:
        if shard in self.segments:
            return tp.rank_part(loaded, 0, self.tp_group, self.segments[shard])
        whole, part, count = self.column_parts[shard]
        if loaded.shape[0] != whole:
            raise ValueError(f"shape {tuple(loaded.shape)}, expected {whole} rows")
        return loaded.narrow(0, part * (whole // count), whole // count)

    def _reduced(self, y: torch.Tensor) -> torch.Tensor:
        """A row-parallel layer's partial output summed over the ranks."""
        return tp.all_reduce(y, self.tp_group) if self.parallel == "row" else y

    @property
    def _bias(self) -> torch.Tensor | None:
        return self.bias if self.reduce_bias else None

    def quant_slots(self, name: str, model: nn.Module) -> list[QuantSlot]:
        """The one weight, its shards checked as the checkpoint modules they were fused from
        (``packed_modules_mapping`` inverted: ``qkv_proj`` shard ``q`` is ``q_proj``)."""
        reverse = {(fused, shard): part for part, (fused, shard) in getattr(model, "packed_modules_mapping", {}).items()}
        parts, modules = name.split("."), []
        for shard in self.shard_names:
            i = next((i for i, p in enumerate(parts) if (p, shard) in reverse), None)
            modules.append(name if i is None else ".".join(parts[:i] + [reverse[(parts[i], shard)]] + parts[i + 1:]))
        shards = tuple((s, sl.stop - sl.start) for s, sl in self.shard_slices.items()) or ((None, self.out_features),)
        return [QuantSlot("weight", "", WeightSpec(name, self.in_features, shards), tuple(modules))]

    def quant_param(self, slot: QuantSlot, tensor: QuantTensor) -> nn.Parameter:
        return self.new_param(tensor.data, per_shard=tensor.per_shard, exact_dtype=True)

    def _gemv_weight(self, x: torch.Tensor, fused: str | None = None) -> object | None:
        """The weight operand of the Triton GEMV for this call (decode-sized rows on CUDA: the dense
        weight, or what the quant method offers, e.g. packed FP4), or None: torch / the quant method's
        own kernel. With an op ``fused`` in (see ``gemv.supports``) only at one row: at M > 1 a
        prologue sits between the loads and the dot and stalls the pipelined loop (a 0.6B decode step
        at batch 2: 2.3 ms with prologues, 1.3 ms with the separate launches, H200)."""
        rows = GEMV_MAX_ROWS if fused is None else PROLOGUE_MAX_ROWS
        if self.parallel == "row" and fused not in (None, "silu_and_mul"):
            return None  # (the paths that sum a row-parallel output over the ranks)
        if not use_gemv(x) or x.dim() != 2 or x.shape[0] > rows:
            return None
        weight = self.weight if self.quant is None else self.quant.gemv_weight(self.quant_weights["weight"])
        from vtcore.kernels import gemv
        return weight if weight is not None and gemv.supports(x, weight, self.bias, fused) else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight = self._gemv_weight(x)
        if weight is not None:  # decode: a Triton GEMV beats cuBLAS (and the FP4 tile GEMM) at small M
            from vtcore.kernels import gemv
            return self._reduced(gemv.gemv(x, weight, self._bias))
        if self.quant is not None:
            return self._reduced(self.quant.apply(self.quant_weights["weight"], x, self._bias))
        return self._reduced(F.linear(x, self.weight, self._bias))

    def forward_gated(self, gate_up: torch.Tensor) -> torch.Tensor:
        """``self(silu(gate) * up)`` for ``gate_up`` = [gate | up]; the SwiGLU fused into the GEMV's loads
        on the GEMV path."""
        weight = self._gemv_weight(gate_up, "silu_and_mul")
        if weight is not None:
            from vtcore.kernels import gemv
            return self._reduced(gemv.gemv_silu_and_mul(gate_up, weight, self._bias))
        return self(silu_and_mul(gate_up))

    def forward_swiglu(self, x: torch.Tensor) -> torch.Tensor:
        """``silu(gate) * up`` for this [gate | up] projection of ``x``: one launch on the one-row
        GEMV path (the SwiGLU as the GEMV's epilogue), else the projection then ``silu_and_mul``."""
        weight = self._gemv_weight(x, "swiglu")
        if weight is not None:
            from vtcore.kernels import gemv
            return gemv.gemv_swiglu(x, weight, self.bias)
        return silu_and_mul(self(x))

    def forward_rms_norm(self, x: torch.Tensor, residual: torch.Tensor, norm: nn.Module
                         ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(self(norm(x + residual)), x + residual)`` for an ``RMSNorm`` ``norm``; one launch when the
        GEMV takes the norm as its prologue."""
        weight = self._gemv_weight(x, "rms_norm") if norm.weight.dtype == x.dtype else None
        if weight is not None:
            from vtcore.kernels import gemv
            return gemv.gemv_rms_norm(x, residual, norm.weight, norm.eps, weight, self.bias, norm.zero_centered)
        h, residual = norm(x, residual)
        return self(h), residual

    def forward_qk_rope(self, x: torch.Tensor, residual: torch.Tensor, norm: nn.Module, rope: "QKRope"
                        ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """``(self(norm(x + residual)), x + residual)`` for a [q | k | v] projection of one decode token,
        with ``rope``'s q/k norm, RoPE and KV-cache write done by the GEMV's epilogue
        (:func:`vtcore.kernels.gemv.gemv_qk_rope`; the norm before it as its prologue where
        ``forward_rms_norm`` would fuse it); None where that GEMV does not apply."""
        weight = self._gemv_weight(x, "qk_rope")
        if weight is None or not rope.fits(x, weight.shape[0]):
            return None
        from vtcore.kernels import gemv
        if norm.weight.dtype == x.dtype and gemv.supports(x, weight, self.bias, "rms_norm"):
            return gemv.gemv_qk_rope(x, weight, rope, self.bias, residual, norm.weight, norm.eps, norm.zero_centered)
        h, residual = norm(x, residual)
        return gemv.gemv_qk_rope(h, weight, rope, self.bias)[0], residual


def loadable_param(data: torch.Tensor, shards: tuple[str | None, ...], loader: Callable[..., None],
                   per_shard: bool = False, exact_dtype: bool = False) -> nn.Parameter:
    """A parameter the weight loader fills one checkpoint tensor a shard through ``loader(param, tensor,
    shard)`` (``shards``: every shard that must arrive; ``per_shard``: one entry per shard);
    ``exact_dtype`` makes the loader refuse a checkpoint tensor of any other dtype instead of casting it."""
    param = nn.Parameter(data, requires_grad=False)
    param.shards = shards
    param.weight_loader = loader
    param.per_shard = per_shard
    param.exact_dtype = exact_dtype
    return param


def copy_checked(target: torch.Tensor, loaded: torch.Tensor) -> None:
    """``target.copy_(loaded)``, refusing a tensor of another shape (the loader names the tensor)."""
    if tuple(target.shape) != tuple(loaded.shape):
        raise ValueError(f"shape {tuple(loaded.shape)}, expected {tuple(target.shape)}")
    target.copy_(tp.materialize(loaded))


def use_gemv(x: torch.Tensor) -> bool:
    """Decode-sized Linear calls on CUDA run the Triton GEMV (tests point this at the interpreter on CPU)."""
    return x.is_cuda
