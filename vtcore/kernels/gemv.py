"""Skinny GEMM for decode: ``y = x @ W.T (+ bias)`` with ``x`` [M, K], M <= 16, ``W`` [N, K].

Weight-streaming and memory-bound: every weight byte is read once, by one program. A program
owns ``BLOCK_N`` weight rows and one K range, and per step loads a ``[BLOCK_N, BLOCK_K]`` weight
tile (contiguous along K: 16-byte vector loads) plus x's matching ``[M, BLOCK_K]`` chunk:

* ``M == 1``: the tile times the x chunk, elementwise, added into a float32 ``[BLOCK_N, BLOCK_K]``
  accumulator that is summed over K once, at the end (no cross-thread reduction per step). Triton
  only software-pipelines loads that feed a dot, so the loop double-buffers in registers by hand:
  the next tile's loads are issued before the current tile's FMAs (checked in the sm_90 PTX);
* ``M > 1``: ``tl.dot(W_tile, x_chunk.T)`` into a float32 ``[BLOCK_N, 16]`` accumulator (x's rows
  padded to 16 with zeros; the weight is the dot's left operand, so BLOCK_N >= 16); ``num_stages``
  pipelines it through shared memory (cp.async).

Split-K: when ``cdiv(N, BLOCK_N)`` is under the SM count (the narrow-N / long-K shapes, e.g.
o_proj and down_proj), the K tiles are also split over a second grid axis; each program writes its
float32 partial to a ``[split, M, N]`` workspace and counts itself in its n tile's arrival counter
(:mod:`vtcore.kernels.workspace`); the last of the tile's programs to arrive sums the partials in
split order 0, 1, ... (then bias, then one rounding). The atomics only count arrivals: the sum's
order is fixed, so results are deterministic (the same bits run to run; they can differ between
configs, i.e. between M == 1 and M > 1 or between split and unsplit, in the float32 summation
order only). One launch per GEMV.

Prologues fuse the op that feeds a decode GEMV into its x loads (the weight stream is unchanged):
``gemv_silu_and_mul`` (down_proj over a [gate | up] input) and ``gemv_rms_norm`` (the residual add
and RMSNorm before qkv_proj / gate_up_proj; each program recomputes the row statistics, since a
row is a few KB, and the programs of split 0 share out writing the new residual). Both round
exactly as their standalone kernels do. One epilogue: ``gemv_swiglu`` (one row, a [gate | up]
weight) gives each program gate rows and their up rows and writes ``silu(gate) * up``, rounded as
the projection then ``silu_and_mul`` would; FP4 weights, which take no prologue, save the SwiGLU's
launch with it.

FP4 (W4A16) weights, an :class:`~vtcore.kernels.fp4.FP4Weight`, take the one-row path with no
prologue: packed int32 words of 8 codes and their group scales are decoded in registers and summed
group-factored (:func:`vtcore.kernels.helpers.fp4_step`), in 64-row x 256-code tiles, split-K as
above. On CUDA with bf16 x and NVFP4 weights (:func:`use_fp4_mma`) the words are decoded to bf16
pairs in inline PTX and summed by ``mma`` instead (:mod:`vtcore.kernels.fp4_mma`; 32-row tiles where
those still make 3x SMs tiles, registers capped so the grid is one wave: :func:`_registers`); the
interpreter and the other formats keep the float32 decode. Both are bound by instruction issue and
latency, not by memory (design.md, "Quantization"); a prologue's per-element work, redone in every
program, would cost more than its own launch.

Launch configs come from host ints only (M, N, K, dtype size, SM count), cached with
``functools.cache``; no autotuning, no sync, no data-dependent grid, so calls can be captured in a
CUDA graph. Allocations: the output, plus the float32 workspace on the split path (a caching-
allocator ``torch.empty`` like the decode attention's scratch: graph-safe, from the graph's pool
under capture).

Heuristic (``_config``; every field can be forced by keyword): aim for >= 3 programs per SM with
~8 KB weight tiles; M == 1 takes BLOCK_N in {16, 8, 4} (largest that gives >= 3x SMs tiles),
``BLOCK_K = 8 KB / (BLOCK_N * itemsize)`` (halved until it divides K, so the hot loop has no mask),
4 warps, 3 stages; M > 1 takes BLOCK_N = 16 (M <= 4) or 32, same tile bytes. Split only when the
tiles are fewer than the SMs (unsplit tiles that fill the SMs beat a split: docs/BENCHMARKS.md,
issue 8). A split is the smallest reaching 3x SMs programs, moved up to a divisor of the K-tile
count when one is within 2x (balanced splits), capped so the partials' traffic (8 * split * M * N
bytes) stays under a quarter of the weight bytes. The float32 FP4 decode, where its tiles outnumber the SMs but not by a
multiple, runs the first ``n_tiles // SMs * SMs`` tiles whole and cuts the rest into short K
pieces launched last (a 1-D grid, ``FULL_TILES``): with one program a tile, the SMs holding one
more tile than the others set the time. The tensor-core path does not take it (its pieces' start-up
costs more than the imbalance: docs/BENCHMARKS.md); its whole-K launches of 4 row repetitions take
the narrow layout (``narrow_layout``).
"""
from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl
from torch.nn import functional as F

from vtcore.kernels.device import num_sms
from vtcore.kernels.fp4 import FP4Weight
from vtcore.kernels.fp4_mma import fp4_mma_rows, layout_ok
from vtcore.kernels.helpers import INTERPRET, cast, fp4_step, load, normalize, silu_mul
from vtcore.kernels.pdl import pdl_launch, wait_prior
from vtcore.kernels.rope import QKRope, head_epilogue
from vtcore.kernels.workspace import arrival_counters

__all__ = ["gemv", "gemv_silu_and_mul", "gemv_rms_norm", "gemv_swiglu", "gemv_qk_rope", "supports", "gemv_ref"]

_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
Weight = torch.Tensor | FP4Weight  # a dense [N, K] weight in x's dtype, or packed FP4
_MAX_M = 16
_TILE_BYTES = 8192  # weight bytes per program per K step
_PROGRAMS_PER_SM = 3  # programs the heuristic aims for
_SPLIT_BELOW_PER_SM = 1  # split K when the N tiles are fewer than this many per SM
_CONFIG_KEYS = ("block_n", "block_k", "split_k", "num_warps", "num_stages")  # _config's forced fields, in order
_LAUNCH_KEYS = _CONFIG_KEYS + ("fp4_mma", "maxnreg")  # every key gemv() takes
_REGISTERS_PER_SM = 65536  # 32-bit registers an SM holds (sm_80 .. sm_90)
_REGISTER_CAP = (64, 128)  # the tensor-core FP4 path's register cap stays in this range (see _registers)


def gemv_ref(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear`` semantics (the torch reference; on bf16 CPU it may differ by 1 ulp from a
    float32-accumulated result, which ``(x.float() @ w.float().T).to(dtype)`` gives)."""
    return F.linear(x, weight, bias)


def supports(x: torch.Tensor, weight: Weight, bias: torch.Tensor | None = None, fused: str | None = None) -> bool:
    """Whether :func:`gemv` (``fused`` None), :func:`gemv_silu_and_mul` ("silu_and_mul": ``x`` is
    [M, 2K]), :func:`gemv_rms_norm` ("rms_norm"), :func:`gemv_swiglu` ("swiglu") or
    :func:`gemv_qk_rope` ("qk_rope"; also check :meth:`QKRope.fits`) handles these operands (else use
    torch)."""
    if not (x.is_cuda or INTERPRET) or x.device != weight.device or x.dim() != 2 or x.dtype not in _DTYPES:
        return False
    if isinstance(weight, FP4Weight):
        g = weight.group_size
        # No prologue: recomputed per x element in every program, it costs the issue-bound FP4 loop
        # more than its own launch (docs/BENCHMARKS.md, issue 9).
        ok = (x.shape[0] == 1 and fused in (None, "swiglu", "qk_rope") and weight.scale_kind in ("e4m3", "e8m0")
              and g >= 8 and not g & (g - 1)
              and weight.packed.storage_offset() % 4 == 0  # read as int32 words
              and weight.shape[1] % g == 0 and weight.packed.dtype == torch.uint8 and weight.scale.dtype == torch.uint8
              and weight.packed.is_contiguous() and weight.scale.is_contiguous()
              and tuple(weight.scale.shape) == (weight.shape[0], weight.shape[1] // g)
              and (weight.row_global is None) == (weight.scale_kind == "e8m0"))
        if not ok or (weight.row_global is not None and (weight.row_global.shape != (weight.shape[0],)
                                                         or weight.row_global.dtype != torch.float32
                                                         or not weight.row_global.is_contiguous()
                                                         or weight.row_global.device != x.device)):
            return False
    elif weight.dim() != 2 or weight.dtype != x.dtype or not weight.is_contiguous():
        return False
    m, k = x.shape[0], weight.shape[1]
    width = 2 * k if fused == "silu_and_mul" else k
    if m > _MAX_M or x.shape[1] != width or k == 0 or k % 8 or x.stride(1) != 1:
        return False
    if fused in ("swiglu", "qk_rope") and (m != 1 or weight.shape[0] % 2):
        return False
    return bias is None or (bias.dtype == x.dtype and bias.shape == (weight.shape[0],) and bias.is_contiguous()
                            and bias.device == x.device)


@triton.jit
def _residual_sum(x_ptr, r_ptr, x_off, r_off, mask, EVEN: tl.constexpr, HAS_RESIDUAL: tl.constexpr,
                  DT: tl.constexpr, INTERPRET: tl.constexpr):
    """float32 ``x`` (+ the residual, the sum rounded to ``DT`` as ``fused_add_rms_norm`` rounds it)."""
    h = load(x_ptr + x_off, mask, EVEN).to(tl.float32)
    if HAS_RESIDUAL:
        h = cast(h + load(r_ptr + r_off, mask, EVEN).to(tl.float32), DT, INTERPRET).to(tl.float32)
    return h


@triton.jit
def _x_tile(x_ptr, r_ptr, nw_ptr, x_off, r_off, cols, mask, rstd, K: tl.constexpr, EVEN: tl.constexpr,
            PROLOGUE: tl.constexpr, HAS_RESIDUAL: tl.constexpr, ZERO_CENTERED: tl.constexpr, DT: tl.constexpr, INTERPRET: tl.constexpr):
    """The input tile at offsets ``x_off`` (columns ``cols``) after the prologue, in ``DT``:
    0: x itself; 1: ``silu(x[:, c]) * x[:, K + c]``; 2: ``rms_norm(x (+ residual))`` with ``rstd``."""
    if PROLOGUE == 1:
        g = load(x_ptr + x_off, mask, EVEN).to(tl.float32)
        u = load(x_ptr + x_off + K, mask, EVEN).to(tl.float32)
        v = silu_mul(g, u, DT, INTERPRET)
    elif PROLOGUE == 2:
        h = _residual_sum(x_ptr, r_ptr, x_off, r_off, mask, EVEN, HAS_RESIDUAL, DT, INTERPRET)
        w = load(nw_ptr + cols, mask, EVEN).to(tl.float32)
        v = cast(normalize(h, rstd, w, ZERO_CENTERED, DT, INTERPRET), DT, INTERPRET)
    else:
        v = load(x_ptr + x_off, mask, EVEN)
    return v


@triton.jit
def _fp4_loads(w_ptrs, s_ptrs, kw, kg, K: tl.constexpr, BLOCK_K: tl.constexpr, GROUP: tl.constexpr,
               EVEN: tl.constexpr):
    """One K step's packed int32 words ``[BLOCK_N, BLOCK_K / 8]`` from word ``kw`` and int32 scale bytes
    ``[BLOCK_N, BLOCK_K / GROUP]`` from group ``kg`` (offsets the caller forms by multiplying, not
    dividing, so the compiler sees their alignment and issues 16-byte loads)."""
    wm = tl.arange(0, BLOCK_K // 8) + kw < K // 8
    gm = tl.arange(0, BLOCK_K // GROUP) + kg < K // GROUP
    return load(w_ptrs + kw, wm[None, :], EVEN), load(s_ptrs + kg, gm[None, :], EVEN).to(tl.int32)


@triton.jit
def _gemv_kernel(
    x_ptr, r_ptr, nw_ptr, r_out_ptr, w_ptr, s_ptr, g_ptr, b_ptr, out_ptr, ws_ptr, sem_ptr,
    pos_ptr, cos_ptr, sin_ptr, qw_ptr, kw_ptr, kc_ptr, vc_ptr, slot_ptr, M, stride_xm, stride_rm,
    eps, stride_cos, stride_ct, stride_ch, qk_eps, N: tl.constexpr, K: tl.constexpr, K_P2: tl.constexpr, K_SPLIT: tl.constexpr, SPLIT: tl.constexpr,
    FULL_TILES: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    EVEN_N: tl.constexpr, EVEN_K: tl.constexpr, HAS_BIAS: tl.constexpr,
    PROLOGUE: tl.constexpr, HAS_RESIDUAL: tl.constexpr, ZERO_CENTERED: tl.constexpr,
    FP4: tl.constexpr, FP4_MMA: tl.constexpr, FP4_NARROW: tl.constexpr, GROUP: tl.constexpr, SCALE_E8M0: tl.constexpr, HAS_GLOBAL: tl.constexpr,
    SWIGLU: tl.constexpr, ROPE: tl.constexpr, NQ: tl.constexpr, NKV: tl.constexpr, QK_NORM: tl.constexpr,
    QK_ZERO_CENTERED: tl.constexpr, DOT_PRECISION: tl.constexpr, INTERPRET: tl.constexpr, PDL: tl.constexpr,
):
    """Program (n tile, k split): ``BLOCK_N`` output columns over K range ``[pid_k * K_SPLIT, +K_SPLIT)``.

    ``PROLOGUE`` (see :func:`_x_tile`) transforms x as it is loaded; the norm's statistics need all
    of a row, so every program first sums its squares over the whole K (x is small and cached: one
    load of the row when M == 1, K tiles otherwise), and the first program (M == 1) or the programs
    of split 0, each n tile a share of the K tiles (M > 1), write the new residual.
    ``SPLIT > 1``: each program stores its float32 partial in ``ws`` [SPLIT, M, N], then counts
    itself in the n tile's arrival counter; the last to arrive sums the SPLIT partials in order,
    adds the bias, rounds once, writes ``out`` and resets the counter.
    ``FULL_TILES > 0`` (one row, no prologue; a 1-D grid): n tiles below ``FULL_TILES`` are one
    program each over all of K; the rest (the tail) are split ``SPLIT`` ways as above, their programs
    launched last, so the short pieces even out the SMs' loads (see :func:`_config`).
    ``SWIGLU`` (one row, a [gate | up] weight of N = 2I rows): an n tile is BLOCK_N / 2 gate rows and
    the same up rows (I further on); its epilogue rounds the sums as the projection's output would be
    and writes ``silu(gate) * up`` [I] (rounded as :func:`vtcore.kernels.helpers.silu_mul`).
    ``ROPE`` (one row of a [q | k | v] projection, BLOCK_N = head_dim): an n tile is a head, which
    its epilogue norms, rotates and writes to the KV cache (:func:`vtcore.kernels.rope.head_epilogue`).
    """
    DT: tl.constexpr = out_ptr.dtype.element_ty
    if FULL_TILES > 0:
        pid = tl.program_id(0)
        split_tile = pid >= FULL_TILES
        piece = tl.maximum(pid - FULL_TILES, 0)
        pid_n = tl.where(split_tile, FULL_TILES + piece // SPLIT, pid)
        pid_k = tl.where(split_tile, piece % SPLIT, 0)
        k_start = pid_k * K_SPLIT
        k_end = tl.where(split_tile, tl.minimum(k_start + K_SPLIT, K), K)
    else:
        split_tile: tl.constexpr = SPLIT > 1
        pid_n = tl.program_id(0)
        pid_k = tl.program_id(1)
        k_start = pid_k * K_SPLIT
        k_end = tl.minimum(k_start + K_SPLIT, K)
    offs_k = tl.arange(0, BLOCK_K)
    # Clamp rows past N onto row N - 1 (SWIGLU: past each half's end onto its last row): every
    # weight load stays in bounds without a mask (the columns they produce are never stored).
    if SWIGLU:
        HALF: tl.constexpr = BLOCK_N // 2
        half = tl.arange(0, BLOCK_N) // HALF  # 0: gate rows, 1: up rows
        col = pid_n * HALF + tl.arange(0, BLOCK_N) % HALF  # the output column of each row
        offs_n = col + half * (N // 2)
        n_mask = col < N // 2
        rows = offs_n if EVEN_N else tl.minimum(col, N // 2 - 1) + half * (N // 2)
    else:
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        n_mask = offs_n < N
        rows = offs_n if EVEN_N else tl.minimum(offs_n, N - 1)
    w_ptrs = w_ptr + rows.to(tl.int64)[:, None] * K + offs_k[None, :]
    # x offsets of column 0 ([BLOCK_K] for one row, [BLOCK_K, BLOCK_M] transposed for several)
    if BLOCK_M == 1:
        m_ok = offs_k >= 0
        x_base = offs_k
        r_base = offs_k
        cols0 = offs_k
    else:
        offs_m = tl.arange(0, BLOCK_M)
        m_ok = (offs_m < M)[None, :] & (offs_k >= 0)[:, None]
        x_base = offs_m[None, :] * stride_xm + offs_k[:, None]
        r_base = offs_m[None, :] * stride_rm + offs_k[:, None]
        cols0 = offs_k[:, None] + offs_m[None, :] * 0
    # PDL: the one-row paths request their first K step's weights (no kernel's output) before waiting
    # on the kernel before, so that load's latency overlaps its end; the rest waits first.
    if BLOCK_M == 1 and not FP4:
        w = load(w_ptrs + k_start, (m_ok if EVEN_K else offs_k + k_start < K)[None, :], EVEN_K)
    if not FP4:
        wait_prior(PDL)
    rstd = 0.0
    if PROLOGUE == 2 and BLOCK_M == 1:  # the whole row in one load: one memory round trip, not K / BLOCK_K
        row = tl.arange(0, K_P2)
        h = _residual_sum(x_ptr, r_ptr, row, row, row < K, False, HAS_RESIDUAL, DT, INTERPRET)
        rstd = tl.rsqrt(tl.sum(h * h, axis=0) * (1.0 / K) + eps)
        if HAS_RESIDUAL and pid_k == 0 and pid_n == 0:
            tl.store(r_out_ptr + row, h.to(DT), mask=row < K)
    elif PROLOGUE == 2:
        ss = tl.sum(tl.zeros_like(x_base).to(tl.float32), axis=0)
        for k0 in range(0, K, BLOCK_K):
            xm = m_ok & (cols0 + k0 < K)
            h = _residual_sum(x_ptr, r_ptr, x_base + k0, r_base + k0, xm, False, HAS_RESIDUAL, DT, INTERPRET)
            ss += tl.sum(h * h, axis=0)
            if HAS_RESIDUAL and pid_k == 0 and (k0 // BLOCK_K) % tl.num_programs(0) == pid_n:
                tl.store(r_out_ptr + offs_m[None, :] * K + k0 + offs_k[:, None], h.to(DT), mask=xm)
        rstd = tl.rsqrt(ss * (1.0 / K) + eps)[None, :]
    if FP4:  # one row, no prologue (the host never picks either); loads double-buffered as below
        if FP4_MMA:  # x_ptr is x's int32 pair view
            y = fp4_mma_rows(w_ptr, s_ptr, x_ptr, rows, k_start, k_end, K, BLOCK_N, BLOCK_K, FP4_NARROW, PDL)
        else:
            rows64 = rows.to(tl.int64)
            w_words = w_ptr + rows64[:, None] * (K // 8) + tl.arange(0, BLOCK_K // 8)[None, :]
            sc_ptrs = s_ptr + rows64[:, None] * (K // GROUP) + tl.arange(0, BLOCK_K // GROUP)[None, :]
            acc = tl.zeros((BLOCK_N, BLOCK_K // 8), dtype=tl.float32)
            kw = pid_k * (K_SPLIT // 8)
            kg = pid_k * (K_SPLIT // GROUP)
            steps = tl.cdiv(k_end - k_start, BLOCK_K)
            w, sb = _fp4_loads(w_words, sc_ptrs, kw, kg, K, BLOCK_K, GROUP, EVEN_K)
            wait_prior(PDL)
            for i in range(1, steps):
                w_next, sb_next = _fp4_loads(w_words, sc_ptrs, kw + i * (BLOCK_K // 8), kg + i * (BLOCK_K // GROUP), K,
                                             BLOCK_K, GROUP, EVEN_K)
                acc += fp4_step(w, sb, x_ptr, k_start + (i - 1) * BLOCK_K, K, 1, BLOCK_N, BLOCK_K, GROUP, SCALE_E8M0,
                                EVEN_K)
                w, sb = w_next, sb_next
            acc += fp4_step(w, sb, x_ptr, k_start + (steps - 1) * BLOCK_K, K, 1, BLOCK_N, BLOCK_K, GROUP, SCALE_E8M0,
                            EVEN_K)
            y = tl.sum(acc, axis=1)
        if HAS_GLOBAL:
            y = tl.div_rn(y, tl.load(g_ptr + rows))
        out_mask = n_mask
        dst = offs_n
        bias_off = offs_n
    elif BLOCK_M == 1:
        # Register double buffering: tile i + 1 is requested before tile i is multiplied, so two
        # tiles per program are in flight (Triton's pipeliner stages only loads that feed a dot).
        # Every program has at least one tile (the host never makes an empty split).
        acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
        xm = m_ok if EVEN_K else offs_k + k_start < K
        xv = _x_tile(x_ptr, r_ptr, nw_ptr, x_base + k_start, r_base + k_start, cols0 + k_start, xm, rstd, K,
                     EVEN_K, PROLOGUE, HAS_RESIDUAL, ZERO_CENTERED, DT, INTERPRET)
        for k0 in range(k_start + BLOCK_K, k_end, BLOCK_K):
            xm = m_ok if EVEN_K else offs_k + k0 < K
            w_next = load(w_ptrs + k0, xm[None, :], EVEN_K)
            x_next = _x_tile(x_ptr, r_ptr, nw_ptr, x_base + k0, r_base + k0, cols0 + k0, xm, rstd, K,
                             EVEN_K, PROLOGUE, HAS_RESIDUAL, ZERO_CENTERED, DT, INTERPRET)
            acc += w.to(tl.float32) * xv.to(tl.float32)[None, :]
            w, xv = w_next, x_next
        acc += w.to(tl.float32) * xv.to(tl.float32)[None, :]
        y = tl.sum(acc, axis=1)  # [BLOCK_N]
        out_mask = n_mask
        dst = offs_n
        bias_off = offs_n
    else:
        acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
        for k0 in range(k_start, k_end, BLOCK_K):
            xm = m_ok & (cols0 + k0 < K)
            w = load(w_ptrs + k0, (offs_k + k0 < K)[None, :], EVEN_K)
            xt = _x_tile(x_ptr, r_ptr, nw_ptr, x_base + k0, r_base + k0, cols0 + k0, xm, rstd, K,
                         False, PROLOGUE, HAS_RESIDUAL, ZERO_CENTERED, DT, INTERPRET)
            acc = tl.dot(w, xt, acc, input_precision=DOT_PRECISION)
        y = tl.trans(acc)  # [BLOCK_M, BLOCK_N]
        out_mask = (offs_m < M)[:, None] & n_mask[None, :]
        dst = offs_m[:, None] * N + offs_n[None, :]
        bias_off = offs_n[None, :]
    if split_tile:  # FULL_TILES > 0 implies SPLIT > 1
        tl.store(ws_ptr + pid_k * (M * N) + dst, y, mask=out_mask)
        tl.debug_barrier()  # every thread's partial is issued before the (release) arrival
        if tl.atomic_add(sem_ptr + pid_n, 1, sem="acq_rel", scope="gpu") != SPLIT - 1:
            return
        tl.atomic_xchg(sem_ptr + pid_n, 0, sem="relaxed", scope="gpu")
        y = tl.load(ws_ptr + dst, mask=out_mask, other=0.0, cache_modifier=".cg")
        for s in tl.static_range(1, SPLIT):
            y += tl.load(ws_ptr + s * (M * N) + dst, mask=out_mask, other=0.0, cache_modifier=".cg")
    if HAS_BIAS:
        y += tl.load(b_ptr + bias_off, mask=bias_off < N, other=0.0).to(tl.float32)
    if ROPE:
        head_epilogue(y, pid_n, out_ptr, pos_ptr, cos_ptr, sin_ptr, stride_cos, qw_ptr, kw_ptr, kc_ptr, vc_ptr,
                      slot_ptr, stride_ct, stride_ch, qk_eps, NQ, NKV, BLOCK_N, QK_NORM, QK_ZERO_CENTERED, DT)
    elif SWIGLU:
        gate, up = tl.split(tl.permute(tl.reshape(cast(y, DT, INTERPRET).to(tl.float32), (2, HALF)), (1, 0)))
        cols = pid_n * HALF + tl.arange(0, HALF)
        tl.store(out_ptr + cols, silu_mul(gate, up, DT, INTERPRET), mask=cols < N // 2)
    else:
        tl.store(out_ptr + dst, cast(y, DT, INTERPRET), mask=out_mask)


def _pick_block_k(k: int, target: int, floor: int) -> int:
    """The largest power of two <= ``target`` (and <= next_pow2(k)) dividing ``k``, not below
    ``floor``; if none does, ``min(target, next_pow2(k))`` (the loop then masks K)."""
    bk = max(16, min(target, triton.next_power_of_2(k)))
    b = bk
    while b > floor and k % b:
        b //= 2
    return b if k % b == 0 else bk


@functools.cache
def _config(m: int, n: int, k: int, bits: int, sms: int, block_n: int | None, block_k: int | None,
            split_k: int | None, num_warps: int | None, num_stages: int | None, fp4_mma: bool = False) -> tuple[int, ...]:
    """(BLOCK_M, BLOCK_N, BLOCK_K, split, K_SPLIT, num_warps, num_stages, full_tiles) for one shape of
    ``bits``-bit weights (16 or 32; 4: packed FP4, ``fp4_mma``: on the tensor-core path); forced
    values win. ``full_tiles`` > 0: only the tiles past it are split (see ``_gemv_kernel``)."""
    target = _PROGRAMS_PER_SM * sms
    if m == 1:
        block_m = 1
        # FP4: 64 rows x 256 codes (8 KB), split-K below the SM count; on tensor cores (bits 4 with
        # ``fp4_mma``) 32 rows where that still makes 3x SMs tiles (both from sweeps: docs/BENCHMARKS.md)
        bn = block_n or ((32 if triton.cdiv(n, 32) >= target else 64) if fp4_mma
                         else 64 if bits == 4 else next((b for b in (16, 8) if triton.cdiv(n, b) >= target), 4))
    else:
        block_m = 16
        bn = block_n or (16 if m <= 4 else 32)
    floor = 32 * 16 * 8 // bits  # one warp of 16-byte loads across K
    bk = block_k or (256 if fp4_mma else _pick_block_k(k, max(16, _TILE_BYTES * 8 // (bn * bits)), floor))
    k_tiles = triton.cdiv(k, bk)
    n_tiles = triton.cdiv(n, bn)
    if split_k is not None:
        split = max(1, min(split_k, k_tiles))
    elif n_tiles < _SPLIT_BELOW_PER_SM * sms and k_tiles > 1:
        # Capped so the float32 partials (written and read back: 8 * split * M * N bytes) stay
        # under a quarter of the weight bytes.
        split = max(1, min(k_tiles, triton.cdiv(target, n_tiles), k * bits // (8 * 32 * m)))
        split = next((s for s in range(split, min(k_tiles, 2 * split) + 1) if k_tiles % s == 0), split)
    else:
        split = 1
    full = 0
    if bits == 4 and not fp4_mma and split == 1 and split_k is None and n_tiles > sms and n_tiles % sms and k_tiles > 1:
        # One program a tile leaves the SMs holding one more tile than others idle (NVFP4 Qwen3-4B
        # gate_up, 304 tiles: 40 SMs do 3, 92 do 2); instead the last n_tiles % sms tiles are cut into
        # short K pieces, launched last, which the SMs that finish first take up.
        full = n_tiles // sms * sms
        split = min(k_tiles, triton.cdiv(_PROGRAMS_PER_SM * sms, n_tiles - full))
    per_split = triton.cdiv(k_tiles, split)
    split = triton.cdiv(k_tiles, per_split)  # no empty splits
    return block_m, bn, bk, split, per_split * bk, num_warps or 4, num_stages or 3, full if split > 1 else 0


def _launch(x: torch.Tensor, weight: Weight, bias: torch.Tensor | None, prologue: int,
            residual: torch.Tensor | None, norm_weight: torch.Tensor | None, eps: float, zero_centered: bool,
            config: dict[str, int], swiglu: bool = False, rope: QKRope | None = None
            ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(out, new residual or None); shapes already checked. ``config`` forces launch parameters;
    ``swiglu``: the SwiGLU epilogue (one row, N even; out [1, N / 2]); ``rope``: the q/k norm, RoPE
    and KV-cache write epilogue (one row; tiles of one head)."""
    unknown = set(config) - set(_LAUNCH_KEYS)
    if unknown:
        raise TypeError(f"gemv: unknown launch parameter(s) {sorted(unknown)}; expected some of {_LAUNCH_KEYS}")
    m, (n, k) = x.shape[0], weight.shape
    out = torch.empty((m, n // 2 if swiglu else n), dtype=x.dtype, device=x.device)
    new_residual = torch.empty((m, k), dtype=x.dtype, device=x.device) if residual is not None else None
    if m == 0 or n == 0:
        return out, new_residual
    fp4 = weight if isinstance(weight, FP4Weight) else None
    w = weight if fp4 is None else fp4.packed.view(torch.int32)  # 8 codes a word
    bits = 4 if fp4 is not None else 8 * x.element_size()
    mma = fp4 is not None and config.get("fp4_mma", True) and use_fp4_mma(x, fp4)
    if rope is not None and config.setdefault("block_n", rope.head_dim) != rope.head_dim:
        raise ValueError(f"gemv_qk_rope: block_n={config['block_n']}: a tile is one head, {rope.head_dim} rows")
    block_m, bn, bk, split, k_split, warps, stages, full = _config(m, n, k, bits, num_sms(x.device),
                                                                   *(config.get(key) for key in _CONFIG_KEYS), mma)
    if fp4 is not None and prologue:
        raise ValueError("gemv: FP4 weights take no prologue (see supports()); run the norm / SwiGLU first")
    if fp4 is not None and (bk % fp4.group_size or bk % 8):
        raise ValueError(f"gemv: block_k={bk} must be a multiple of group_size={fp4.group_size} (and of 8) for FP4")
    mma = mma and fp4_mma_tile(bn, bk, warps)  # a forced tile may not fit the PTX
    if config.get("fp4_mma") and not mma:
        raise ValueError(f"gemv: fp4_mma forced but x {x.dtype} on {x.device}, {fp4 and fp4.scale_kind} scales, "
                         f"group {fp4 and fp4.group_size}, K {k}, tile {bn} x {bk} over {warps} warps do not qualify "
                         "(see use_fp4_mma and fp4_mma_tile)")
    n_tiles = triton.cdiv(n, bn)  # SWIGLU: cdiv(n / 2, bn / 2), the same
    grid = (full + (n_tiles - full) * split,) if full else (n_tiles, split)  # full > 0: the float32 decode only
    maxnreg = config.get("maxnreg", (_registers(n_tiles * split, num_sms(x.device), warps) if mma else 0) or 0)
    if isinstance(maxnreg, bool) or not isinstance(maxnreg, int) or not 0 <= maxnreg <= 255:
        raise ValueError(f"gemv: maxnreg={maxnreg!r}: expected registers a thread may use, 1..255, or 0 (ptxas's "
                         "choice)")
    ws = torch.empty((split, m, n), dtype=torch.float32, device=x.device) if split > 1 else out
    sem = arrival_counters(x.device, n_tiles) if split > 1 else out
    _gemv_kernel[grid](
        x[0].view(torch.int32) if mma else x, x if residual is None else residual, w if norm_weight is None else norm_weight,
        out if new_residual is None else new_residual, w, w if fp4 is None else fp4.scale,
        w if fp4 is None or fp4.row_global is None else fp4.row_global, w if bias is None else bias, out, ws, sem,
        *((rope.positions, rope.cos_cache, rope.sin_cache, rope.q_weight if rope.q_weight is not None else out,
           rope.k_weight if rope.k_weight is not None else out, rope.k_cache, rope.v_cache, rope.slot_mapping)
          if rope is not None else (out,) * 8),
        m, x.stride(0), 0 if residual is None else residual.stride(0), eps,
        *((rope.cos_cache.stride(0), rope.k_cache.stride(0), rope.k_cache.stride(1), rope.eps) if rope is not None
          else (0, 0, 0, 0.0)),
        N=n, K=k, K_P2=triton.next_power_of_2(k), K_SPLIT=k_split, SPLIT=split, FULL_TILES=full, BLOCK_M=block_m, BLOCK_N=bn, BLOCK_K=bk,
        EVEN_N=n % bn == 0, EVEN_K=k % bk == 0, HAS_BIAS=bias is not None, PROLOGUE=prologue,
        HAS_RESIDUAL=residual is not None, ZERO_CENTERED=zero_centered, FP4=fp4 is not None, FP4_MMA=mma,
        FP4_NARROW=mma and narrow_layout(bn, split, warps),
        GROUP=1 if fp4 is None else fp4.group_size, SCALE_E8M0=fp4 is not None and fp4.scale_kind == "e8m0",
        HAS_GLOBAL=fp4 is not None and fp4.row_global is not None, SWIGLU=swiglu, ROPE=rope is not None,
        NQ=rope.q_heads if rope else 0, NKV=rope.kv_heads if rope else 0,
        QK_NORM=rope is not None and rope.q_weight is not None, QK_ZERO_CENTERED=rope is not None and rope.zero_centered,
        DOT_PRECISION="ieee" if x.dtype == torch.float32 else "tf32",  # tf32 is moot for 16-bit inputs
        INTERPRET=INTERPRET, num_warps=warps, num_stages=stages, **({"maxnreg": maxnreg} if maxnreg else {}),
        **pdl_launch(x.device),
        enable_fp_fusion=True)  # pinned: Triton 3.10 flips the default
    return out, new_residual


def _registers(programs: int, sms: int, num_warps: int) -> int | None:
    """The register cap (ptx ``.maxnreg``) for a tensor-core FP4 launch of ``programs`` programs: the
    most (a multiple of 8, at most 128) that keeps the whole grid resident at once, or None (ptxas's
    choice) where under 64 would be needed.

    Why: the loop is latency-bound and ptxas, left to itself, keeps registers low by issuing each K
    step's weight loads just before their use; capped, it issues them most of a step ahead
    (``scripts/sass_fp4_mma.py`` reads it off the sm_90 SASS; registers, load distances and timings
    in docs/BENCHMARKS.md).
    """
    per_sm = triton.cdiv(programs, sms)
    regs = _REGISTERS_PER_SM // (per_sm * num_warps * 32) // 8 * 8
    return min(regs, _REGISTER_CAP[1]) if regs >= _REGISTER_CAP[0] else None


def use_fp4_mma(x: torch.Tensor, weight: FP4Weight) -> bool:
    """Whether the one-row FP4 GEMV runs on tensor cores (:mod:`vtcore.kernels.fp4_mma`): compiled
    NVIDIA CUDA (sm_89+, for the e4m3 scale conversion; inline PTX does not interpret), bf16 x, NVFP4
    weights (e4m3 scales, group 16), K a multiple of the 256-code step, and x, the packed words and the
    scales 16-byte aligned (x and the words are read as int32 vectors: with less, Triton lays the tile
    out otherwise than the PTX assumes and the sums come out wrong; the scales' 1- and 2-byte loads
    need less, asked the same for simplicity). The launch tile must fit too (:func:`fp4_mma_tile`)."""
    return (x.is_cuda and not INTERPRET and torch.version.hip is None and x.dtype == torch.bfloat16
            and weight.scale_kind == "e4m3" and weight.group_size == 16 and x.shape[1] % 256 == 0
            and all(t.data_ptr() % 16 == 0 for t in (x, weight.packed, weight.scale))
            and torch.cuda.get_device_capability(x.device) >= (8, 9))


def narrow_layout(block_n: int, split: int, num_warps: int) -> bool:
    """Whether a tensor-core FP4 launch takes the narrow layout (:mod:`vtcore.kernels.fp4_mma`: 2 words
    a lane, 4 rows a thread sharing x): for whole-K programs of 4 row repetitions, where it is the
    faster; the split-K launches (2-5 steps a program) keep the wide one (docs/BENCHMARKS.md)."""
    return split == 1 and block_n == 8 * num_warps


def fp4_mma_tile(block_n: int, block_k: int, num_warps: int) -> bool:
    """Whether a launch tile suits the tensor-core FP4 path: 256-code K steps in the PTX's layout."""
    return block_k == 256 and layout_ok(block_n, block_k // 8, num_warps)


def _check(name: str, x: torch.Tensor, weight: Weight, width: int, expected: str) -> None:
    max_m = 1 if isinstance(weight, FP4Weight) else _MAX_M
    if x.dim() != 2 or len(weight.shape) != 2 or x.shape[1] != width or x.shape[0] > max_m:
        raise ValueError(f"{name}: x {tuple(x.shape)}, weight {tuple(weight.shape)}: expected {expected} "
                         f"{'(FP4 weights take one row) ' if max_m == 1 else ''}"
                         "(see supports() for the dtype and layout rules)")


def gemv(x: torch.Tensor, weight: Weight, bias: torch.Tensor | None = None, **config: int) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` for ``x`` [M, K] (M <= 16; rows may be strided, the last dim
    contiguous), ``weight`` [N, K] contiguous, ``bias`` [N]; all one dtype (bf16/fp16/fp32), see
    :func:`supports`. Returns a new contiguous [M, N] tensor in x's dtype: float32 accumulation,
    bias added in float32, one rounding.

    Keywords (``block_n``, ``block_k``, ``split_k``, ``num_warps``, ``num_stages``; also taken by the
    prologue variants) force parts of the launch config (powers of two; ``block_n`` >= 16 when M > 1;
    ``split_k`` is capped at the number of K tiles); by default :func:`_config` picks them.

    ``weight`` may be an :class:`~vtcore.kernels.fp4.FP4Weight` (W4A16, one row only): the codes
    and scales are decoded in registers (:func:`vtcore.kernels.helpers.fp4_step`), ``block_k`` then a
    multiple of the group size; NVFP4 with bf16 x on CUDA is summed on tensor cores where
    :func:`use_fp4_mma` and :func:`fp4_mma_tile` allow (keyword ``fp4_mma``: 0 keeps the float32
    decode, 1 requires the tensor cores and raises ValueError where they do not apply; ``maxnreg``
    caps a thread's registers, 0 leaving them to ptxas, by default :func:`_registers` on tensor
    cores and ptxas's choice elsewhere).
    """
    _check("gemv", x, weight, weight.shape[-1], f"x [M<={_MAX_M}, K] and weight [N, K]")
    return _launch(x, weight, bias, 0, None, None, 0.0, False, config)[0]


def gemv_silu_and_mul(gate_up: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                      **config: int) -> torch.Tensor:
    """``F.linear(silu(gate) * up, weight, bias)`` for ``gate_up`` [M, 2K] = [gate | up]: SwiGLU
    computed as x is loaded, rounded as :func:`vtcore.kernels.activation.silu_and_mul` rounds it."""
    k = weight.shape[-1]
    _check("gemv_silu_and_mul", gate_up, weight, 2 * k, f"gate_up [M<={_MAX_M}, {2 * k}] for weight [N, {k}]")
    return _launch(gate_up, weight, bias, 1, None, None, 0.0, False, config)[0]


def gemv_swiglu(x: torch.Tensor, weight: Weight, bias: torch.Tensor | None = None, **config: int) -> torch.Tensor:
    """``silu(gate) * up`` for ``[gate | up] = F.linear(x, weight, bias)``, ``x`` [1, K] and ``weight``
    [2I, K] (dense or :class:`~vtcore.kernels.fp4.FP4Weight`): [1, I], equal to
    ``silu_and_mul(gemv(x, weight, bias))`` (the projection rounded to x's dtype, then SwiGLU rounded
    as :func:`vtcore.kernels.activation.silu_and_mul`) in one launch: the SwiGLU is the GEMV's
    epilogue (for FP4 weights, which take no prologue, this saves the SwiGLU launch)."""
    _check("gemv_swiglu", x, weight, weight.shape[-1], "x [1, K] and a [gate | up] weight [2I, K]")
    if x.shape[0] != 1 or weight.shape[0] % 2:
        raise ValueError(f"gemv_swiglu: x {tuple(x.shape)}, weight {tuple(weight.shape)}: expected one row of x and an "
                         "even number of weight rows ([gate | up])")
    return _launch(x, weight, bias, 0, None, None, 0.0, False, config, swiglu=True)[0]


def gemv_rms_norm(x: torch.Tensor, residual: torch.Tensor | None, norm_weight: torch.Tensor, eps: float,
                  weight: torch.Tensor, bias: torch.Tensor | None = None, zero_centered: bool = False,
                  **config: int) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``(F.linear(rms_norm(h), weight, bias), h)`` with ``h = residual + x`` (or ``x``, then None
    is returned for it): :func:`vtcore.kernels.rmsnorm.fused_add_rms_norm` (or ``rms_norm``) fed into
    the GEMV in one launch. ``norm_weight`` [K] in x's dtype; ``residual`` contiguous, like x."""
    k = weight.shape[-1]
    _check("gemv_rms_norm", x, weight, k, f"x [M<={_MAX_M}, {k}] for weight [N, {k}]")
    _check_norm("gemv_rms_norm", x, residual, norm_weight, k)
    return _launch(x, weight, bias, 2, residual, norm_weight, eps, zero_centered, config)


def _check_norm(name: str, x: torch.Tensor, residual: torch.Tensor | None, norm_weight: torch.Tensor, k: int) -> None:
    if norm_weight.shape != (k,) or norm_weight.dtype != x.dtype or (
            residual is not None and (residual.shape != x.shape or residual.dtype != x.dtype
                                      or residual.stride(1) != 1)):
        raise ValueError(f"{name}: norm_weight {tuple(norm_weight.shape)} {norm_weight.dtype}, residual "
                         f"{None if residual is None else (tuple(residual.shape), residual.dtype)}: expected norm_weight "
                         f"[{k}] and a residual shaped like x {tuple(x.shape)}, all {x.dtype}")


def gemv_qk_rope(x: torch.Tensor, weight: Weight, rope: QKRope, bias: torch.Tensor | None = None,
                 residual: torch.Tensor | None = None, norm_weight: torch.Tensor | None = None, eps: float = 0.0,
                 zero_centered: bool = False, **config: int) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One decode token's attention inputs in one launch: ``qkv = F.linear(x, weight, bias)`` ([1, N],
    N = (q_heads + 2 kv_heads) x head_dim), then, as :func:`vtcore.kernels.rope.qk_norm_rope` with its
    cache write would do it in place, q and k heads normed and rotated and the token's k and v written
    to its cache slot; returns ``(qkv, None)``. With ``norm_weight`` (dense weights, see
    :func:`supports`), x first goes through :func:`gemv_rms_norm`'s prologue: ``(qkv, h)`` with ``h =
    residual + x``. Saves the ``qk_norm_rope`` launch a decode layer (for FP4 weights, one of two)."""
    k = weight.shape[-1]
    _check("gemv_qk_rope", x, weight, k, f"x [1, {k}] for weight [N, {k}]")
    if not rope.fits(x, weight.shape[0]):
        raise ValueError(f"gemv_qk_rope: x {tuple(x.shape)} {x.dtype}, weight {tuple(weight.shape)}: the rope operands "
                         f"({rope.q_heads} q heads, {rope.kv_heads} kv heads, head_dim {rope.head_dim}) do not fit "
                         "(see QKRope.fits)")
    if norm_weight is None:
        return _launch(x, weight, bias, 0, None, None, 0.0, False, config, rope=rope)
    _check_norm("gemv_qk_rope", x, residual, norm_weight, k)
    return _launch(x, weight, bias, 2, residual, norm_weight, eps, zero_centered, config, rope=rope)
