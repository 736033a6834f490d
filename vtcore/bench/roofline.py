"""The memory roofline of one decode step, measured in the same run as the benchmark.

A decode step at concurrency ``c`` must at least move

* the model's parameter bytes: the sum of ``nbytes`` over the loaded model's parameters, each tensor
  counted once (tied parameters, such as a tied embedding / LM head, share storage and count once);
  routed experts count only the share a step of ``c`` sequences is expected to touch
  (``Experts.active_fraction``: ``1 - (1 - k/E)^c`` under uniform routing, so ``k/E`` at batch 1);
* the KV cache read for ``c`` sequences of ``input_len + output_len / 2`` tokens (the mean context
  over a request's decode): per token ``2 * kv_heads * head_dim * dtype size`` for every attention
  layer of the runner. Recurrent state of stateful (e.g. linear-attention) layers is not counted.

The device's copy bandwidth is measured: a ~256 MiB tensor copied on the device (after one untimed
warm-up copy), ``2 * nbytes`` (read + write) over the median wall time of several timed copies, each
bracketed by ``torch.cuda.synchronize`` on CUDA. ``roofline_ms = bytes / bandwidth``; the benchmark
reports ``TPOT / roofline`` (1.0 would be a decode step running at copy bandwidth).

A prefill has a compute floor beside it: :func:`prefill_flops` counts the operations a prompt computed
from scratch needs at least, and :func:`measure_matmul_rate` times a square matmul of the model's dtype
on the device before the engine is built (CUDA: 8192 on a side, the rate a large prefill GEMM can reach;
CPU: 256); the floor is
``flops / rate``, and the benchmark reports ``TTFT / floor`` for a lone prompt (concurrency 1).

The closed loop's step (:func:`closed_loop_floor`): while a request decodes, the other ``c - 1`` requests of
the loop finish and are replaced, each new one computing its prompt once; over a request's ``output_len``
steps that is ``(c - 1) / output_len`` prompts a step, which the decode-bytes roofline leaves out. The
step's floor is the KV read at copy bandwidth (attention) plus the larger of the weights at copy bandwidth
and the step's matrix operations at the matmul rate (its GEMMs read the weights once for the decode rows and
the prompts' rows together, so those two overlap), and the benchmark reports ``TPOT / closed-loop floor``.
"""
from __future__ import annotations

import functools
import statistics
import time
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch


DEFAULT_COPY_MIB = 256
COPY_REPEATS = 5
MATMUL_SIDE = {"cuda": 8192, "cpu": 256}  # the timed matmul's side per device type


def _routed_share(model: torch.nn.Module, batch: int) -> dict[int, float]:
    """``id(parameter)`` -> the share of it a step of ``batch`` sequences (tokens) reads, for the parameters of
    a module with ``active_fraction`` (routed experts); others are absent (read whole)."""
    return {id(p): m.active_fraction(batch) for m in model.modules() if hasattr(m, "active_fraction")
            for p in m.parameters(recurse=False)}


def parameter_bytes(model: torch.nn.Module, batch: int | None = None) -> int:
    """Sum of parameter ``nbytes``, a tensor shared by several names (tied weights) counted once.

    With ``batch``, the bytes a decode step of that many sequences reads: a module with
    ``active_fraction(batch)`` (routed experts) counts its own parameters times that fraction.
    """
    scale = _routed_share(model, batch) if batch is not None else {}
    seen: set[tuple[Any, int, int]] = set()
    total = 0.0
    for p in model.parameters():  # already yields each Parameter object once
        key = (p.device, p.data_ptr(), p.nbytes)
        if p.nbytes and key in seen:  # distinct Parameter objects viewing the same memory
            continue
        seen.add(key)
        total += p.nbytes * scale.get(id(p), 1.0)
    return round(total)


def kv_bytes_per_token(attention_layers: list[Any], dtype: torch.dtype) -> int:
    """K and V bytes one token occupies across the attention layers (``2 * kv_heads * head_dim * size``)."""
    import torch

    size = torch.empty((), dtype=dtype).element_size()
    return sum(2 * a.num_kv_heads * a.head_dim * size for a in attention_layers)


def decode_step_bytes(param_bytes: int, kv_per_token: int, concurrency: int, input_len: int,
                      output_len: int) -> dict[str, int]:
    """Bytes one decode step moves at ``concurrency``: parameters + KV read over the mean context.

    The context is ``input_len + output_len / 2`` tokens; ``kv_per_token`` is even (a K and a V), so the
    product stays an exact integer.
    """
    kv = concurrency * (kv_per_token * input_len + (kv_per_token // 2) * output_len)
    return {"param_bytes": param_bytes, "kv_bytes": kv, "bytes": param_bytes + kv}


def _timed_runs(run: Any, device: torch.device, repeats: int) -> list[float]:
    """Wall seconds of ``repeats`` calls of ``run`` after one untimed warm-up (page faults, lazy init),
    each bracketed by a synchronize on CUDA."""
    import torch

    cuda = device.type == "cuda"
    times = []
    for i in range(repeats + 1):
        if cuda:
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        run()
        if cuda:
            torch.cuda.synchronize(device)
        if i:
            times.append(time.perf_counter() - t0)
    return times


def _release(device: torch.device) -> None:
    """Hand a measurement's buffers back to the device (measured before the engine is built, whose KV cache
    sizes itself to the memory left)."""
    import torch

    if device.type == "cuda":
        torch.cuda.empty_cache()


def measure_copy_bandwidth(device: torch.device | str, mib: int = DEFAULT_COPY_MIB,
                           repeats: int = COPY_REPEATS) -> dict[str, Any]:
    """Copy a ``mib`` MiB tensor on ``device``: bandwidth = 2 * nbytes / median(timed copies)."""
    import torch

    device = torch.device(device)
    n = mib * 2**20
    src = torch.ones(n, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    try:
        times = _timed_runs(functools.partial(dst.copy_, src), device, repeats)
    finally:
        del src, dst
        _release(device)
    median = statistics.median(times)
    moved = 2 * n
    return {"device": str(device), "nbytes": n, "bytes_moved_per_copy": moved, "times_s": times,
            "median_s": median, "bandwidth_bytes_s": moved / median}


def roofline_for_run(step: dict[str, int], bandwidth_bytes_s: float, tpot_s: float | None) -> dict[str, Any]:
    """One concurrency's roofline: ``roofline_ms = bytes / bandwidth``, ``tpot_over_roofline``."""
    roof_s = step["bytes"] / bandwidth_bytes_s
    return {**step, "roofline_ms": roof_s * 1e3,
            "tpot_over_roofline": (tpot_s / roof_s) if tpot_s is not None else None}


def closed_loop_floor(step: dict[str, int], bandwidth_bytes_s: float, token_flops: int | None,
                      prompt_flops: int | None, flop_s: float, concurrency: int, output_len: int,
                      tpot_s: float | None) -> dict[str, Any] | None:
    """One concurrency's closed-loop step floor (module docstring): ``kv / bandwidth + max(params / bandwidth,
    (c * token_flops + (c - 1) / output_len * prompt_flops) / flop_s)``; None without the flop counts
    (packed weights). ``token_flops``: a decode token's matrix operations (``prefill_flops`` of one token)."""
    if token_flops is None or prompt_flops is None:
        return None
    prompts = (concurrency - 1) / output_len
    matmul_s = (concurrency * token_flops + prompts * prompt_flops) / flop_s
    kv_s, weights_s = step["kv_bytes"] / bandwidth_bytes_s, step["param_bytes"] / bandwidth_bytes_s
    floor_s = kv_s + max(weights_s, matmul_s)
    return {"prompts_per_step": prompts, "kv_ms": kv_s * 1e3, "weights_ms": weights_s * 1e3,
            "matmul_ms": matmul_s * 1e3, "floor_ms": floor_s * 1e3,
            "tpot_over_floor": None if tpot_s is None else tpot_s / floor_s}


def prefill_flops(model: torch.nn.Module, attention_layers: list[Any], prompt_len: int) -> int | None:
    """The floating-point operations a prompt of ``prompt_len`` tokens computed from scratch needs at least.

    Per token, 2 per element of every matrix parameter (two or more dimensions) of the decoder; a module
    with ``active_fraction`` (routed experts) counts its own at ``active_fraction(1)``, the share one token
    uses. The LM head counts once (only the last token's logits are computed); embedding lookups
    (``EmbedInto``), norms, biases and element-wise work count nothing, nor does a draft head
    (``model.mtp``). Causal attention adds its two products, ``2 * 2 * heads * head_dim * n * (n + 1) / 2``
    a layer. Stateful layers' recurrences (linear attention) are not counted, so a hybrid model's floor
    lies below its true work. None for a model with packed (non-floating) weights, whose stored elements
    are not its operands.
    """
    from vtcore.layers.embedding import EmbedInto

    head = getattr(model, "lm_head", None)
    skip = {id(p) for m in model.modules() if isinstance(m, EmbedInto) for p in m.parameters()}
    for sub in (head, getattr(model, "mtp", None)):
        if sub is not None:
            skip |= {id(p) for p in sub.parameters()}
    share = _routed_share(model, 1)
    per_token = 0.0
    for p in model.parameters():
        if id(p) in skip or p.dim() < 2:
            continue
        if not p.is_floating_point():
            return None
        per_token += 2 * p.numel() * share.get(id(p), 1.0)
    lm_head = 2 * head.weight.numel() if head is not None else 0
    attention = sum(2 * a.num_heads * a.head_dim * prompt_len * (prompt_len + 1) for a in attention_layers)
    return round(per_token * prompt_len) + lm_head + attention


def measure_matmul_rate(device: torch.device | str, dtype: torch.dtype, side: int | None = None,
                        repeats: int = COPY_REPEATS) -> dict[str, Any]:
    """Time ``side`` x ``side`` by ``side`` x ``side`` matmuls of ``dtype`` on ``device`` (after one untimed
    warm-up): rate = ``2 * side**3`` over the median wall time, each bracketed by a synchronize on CUDA."""
    import torch

    device = torch.device(device)
    n = side or MATMUL_SIDE.get(device.type, MATMUL_SIDE["cpu"])
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    try:
        times = _timed_runs(functools.partial(torch.mm, a, b), device, repeats)
    finally:
        del a, b
        _release(device)
    median = statistics.median(times)
    return {"side": n, "dtype": str(dtype).replace("torch.", ""), "times_s": times, "median_s": median,
            "flop_s": 2 * n**3 / median}


def prefill_floor(flops: int | None, rate: dict[str, Any], prompt_len: int) -> dict[str, Any]:
    """A prompt's compute floor: ``floor_ms = flops / matmul rate`` (None without a flop count)."""
    return {"prompt_tokens": prompt_len, "flops": flops, "matmul": rate,
            "floor_ms": None if flops is None else flops / rate["flop_s"] * 1e3}
