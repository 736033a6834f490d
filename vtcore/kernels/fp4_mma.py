"""NVFP4 decode GEMV on tensor cores: packed FP4 codes decoded to bf16 pairs and summed by ``mma``.

The one-row FP4 GEMV (:mod:`vtcore.kernels.gemv`) is bound by instruction issue, not memory: a
float32 decode costs three integer ops and an FMA a code. Here (CUDA, sm_89+, bf16 x, e4m3 group-16
scales: NVFP4) the decode is Marlin-style packed 16-bit work in inline PTX, and the multiply-adds
go to the tensor cores:

* A word ``q`` of 8 codes (code ``j`` in nibble ``j``) gives four bf16x2 registers, pair ``n`` holding
  codes ``n`` and ``n + 4``: the magnitude bits ``e e m`` at bf16 bits 8..6 and the sign at bit 15 of
  each half (``c * 2^-126``, the e == 0 codes as bf16 subnormals); three ops a pair (mask, a multiply
  that adds two shifted copies, mask: :func:`_pairs`).
* The group's e4m3 scale, converted by the hardware (``cvt.rn.f16x2.e4m3x2``, sm_89+) and times 2^119
  (a normal bf16 for every e4m3 value), multiplies each pair (``fma.rn.bf16x2``): ``w = c * s * 2^-7``,
  exact in bf16 (<= 6 significant bits) and normal.
* ``mma.m16n8k16`` with the weights as A: a thread's pairs of two weight rows R, R' (rows
  4 x warps apart, the same words) go in as A's two row halves, x's matching bf16 pairs (a byte permute
  of the loaded words) as B's column ``groupID``. Row ``groupID`` of the product, column
  ``groupID`` (the diagonal), is R's sum over the 16 codes its lane quad holds; the other 7
  columns are cross terms and are dropped. The accumulator carries the diagonal over all K steps.

This needs Triton's register layout of the ``[BLOCK_N, 32]`` word tile (256 codes a K step): 4
int32 words a lane along K (one 16-byte load), 8 lanes a row (so a lane quad shares a row), and row
repetitions in consecutive registers (``pack=8``: 4 words of row R, then 4 of R' = R + 4 * warps).
The scales and x are loaded into that same layout (indices contiguous in 4s; x broadcast over the
rows), so Triton changes no layout inside the loop (an earlier version loaded them otherwise and
Triton 3.6 moved the whole tile through shared memory every step). The host only launches tiles
where the layout holds (:func:`layout_ok`, and 16-byte aligned operands: with a smaller alignment
Triton picks another layout, found in review); the GPU tests pin every code to its row and column and
check the sums against the float64 reference. Measured on the H200 (docs/BENCHMARKS.md): about 2x
the float32 decode on NVFP4 Qwen3-4B gate_up; the loop is bound by integer instruction issue (ptxas's
SASS for gate_up, ``scripts/sass_fp4_mma.py``: ~207 instructions a 256-code step, a third of them
LOP3) and latency with ~4 warps a scheduler (left to choose, ptxas issues each step's loads late,
whatever the source order, to save registers: the launch caps them, see
``vtcore.kernels.gemv._registers``). L2 prefetch of the weights did not help (BENCHMARKS.md). The
interpreter cannot run inline PTX: CPU tests cover the plain decode GEMV.
"""
from __future__ import annotations

import triton
import triton.language as tl

from vtcore.kernels.pdl import wait_prior

__all__ = ["layout_ok", "fp4_mma_rows"]

_MASK_PAIR = "0x81C081C0"  # bf16 bits 6..8 and 15 of both halves


def layout_ok(block_n: int, block_kw: int, num_warps: int) -> bool:
    """Whether a ``[block_n, block_kw]`` int32 word tile over ``num_warps`` warps has the layout the
    PTX assumes: 32 words (256 codes) a K step, 8 lanes a row with 4 words each (one 16-byte load; a
    lane quad then shares a row), and at least two row repetitions (R and R')."""
    return block_kw == 32 and block_n % (2 * 4 * num_warps) == 0


def _pairs(q: str, dst: str) -> list[str]:
    """PTX: word register ``q`` -> bf16x2 registers ``dst0..dst3`` (pair n = codes n, n + 4): each
    pair's two nibbles masked out (codes 2, 3 and 6, 7 from ``q >> 8``) and multiplied by the sum of two
    powers of two, which adds two shifted copies that share no bit: one puts the magnitude bits at bf16
    bits 6..8 (22..24), the other the sign at 15 (31); a mask keeps those. Three ops a pair, one of
    them a multiply: the decode's shifts and masks otherwise all queue for the integer ALU pipe."""
    ops = [f"shr.b32 %h, {q}, 8;"]
    for n in range(4):
        mask, times = ("0x000F000F", "0x1040") if n % 2 == 0 else ("0x00F000F0", "0x104")  # 2^6 + 2^12, 2^2 + 2^8
        ops += [f"and.b32 %m, {q if n < 2 else '%h'}, {mask};", f"mul.lo.u32 %m, %m, {times};",
                f"and.b32 {dst}{n}, %m, {_MASK_PAIR};"]
    return ops


def _scales(v: str, dst: str) -> list[str]:
    """PTX: the e4m3 bytes in bits 0..7 and 8..15 of ``v`` -> bf16x2 ``dst0`` = (s0, s0) * 2^119 and
    ``dst1`` = (s1, s1) * 2^119, both groups at once: the hardware's e4m3x2 -> f16x2 conversion (sm_89+),
    each half widened to float32 and the pair rounded to bf16x2 (all exact: 3 mantissa bits), then
    times 2^119 in bf16x2 (exact, normal: 2^-9 .. 448 scales); NaN (0x7f / 0xff) stays NaN."""
    return [
        f"cvt.u16.u32 %sb, {v};", "cvt.rn.f16x2.e4m3x2 %m, %sb;", "mov.b32 {%h0, %h1}, %m;",
        "cvt.f32.f16 %f0, %h0;", "cvt.f32.f16 %f1, %h1;", "cvt.rn.bf16x2.f32 %m, %f1, %f0;",
        "fma.rn.bf16x2 %m, %m, %c119, %z;",
        f"prmt.b32 {dst}0, %m, %m, 0x1010;", f"prmt.b32 {dst}1, %m, %m, 0x3232;",
    ]


def _step_asm() -> str:
    """One K step (256 codes) of one thread's rows R (elements 0..3: its words 0..3) and R' (4..7).

    Operands: $0..$7 accumulators out (chain A = words 0, 1 in $0..$3, chain B = words 2, 3 in $4..$7,
    each an mma C fragment); $8..$15 accumulators in; $16..$23 words; $24..$31 the row's 16 scale
    bytes of the step as four int32 (R: $24..$27, R': $28..$31; lane ``t`` = lane % 8 owns words
    ``4t..4t+3``, groups ``2t, 2t+1``: bytes ``2t, 2t+1``); $32..$63 x's int32 bf16 pairs, ``$32 + 8j + i``
    = pair ``i`` of the thread's word ``j`` (x columns ``8w + 2i``, ``8w + 2i + 1``)."""
    ops = ["{", ".reg .b32 %m, %h, %z, %c119, %l, %v, %w;", ".reg .pred %p1, %p2;", ".reg .b16 %sb, %h0, %h1;",
           ".reg .f32 %f0, %f1;", ".reg .b32 %sa<2>, %sr<2>, %ra<4>, %rb<4>, %x<4>;", "mov.b32 %z, 0x80008000;",
           "mov.b32 %c119, 0x7B007B00;",  # bf16x2 (2^119, 2^119)
           # this lane's scale halfword: int32 slot t // 2, shifted by 16 * (t % 2)
           "mov.u32 %l, %laneid;", "and.b32 %m, %l, 2;", "setp.ne.u32 %p1, %m, 0;", "and.b32 %m, %l, 4;",
           "setp.ne.u32 %p2, %m, 0;", "and.b32 %l, %l, 1;", "shl.b32 %l, %l, 4;"]
    for base, dst in ((24, "%sa"), (28, "%sr")):  # R, R'
        ops += [f"selp.b32 %v, ${base + 1}, ${base}, %p1;", f"selp.b32 %w, ${base + 3}, ${base + 2}, %p1;",
                "selp.b32 %v, %w, %v, %p2;", "shr.b32 %v, %v, %l;"]
        ops += _scales("%v", dst)
    for j in range(4):  # word j of R ($16 + j) and of R' ($20 + j)
        ops += _pairs(f"${16 + j}", "%ra") + _pairs(f"${20 + j}", "%rb")
        ops += [f"fma.rn.bf16x2 %ra{n}, %ra{n}, %sa{j // 2}, %z;" for n in range(4)]
        ops += [f"fma.rn.bf16x2 %rb{n}, %rb{n}, %sr{j // 2}, %z;" for n in range(4)]
        v = [f"${32 + 8 * j + i}" for i in range(4)]  # (x[8w+2i], x[8w+2i+1])
        ops += [f"prmt.b32 %x0, {v[0]}, {v[2]}, 0x5410;", f"prmt.b32 %x1, {v[0]}, {v[2]}, 0x7632;",
                f"prmt.b32 %x2, {v[1]}, {v[3]}, 0x5410;", f"prmt.b32 %x3, {v[1]}, {v[3]}, 0x7632;"]
        out = 4 * (j // 2)
        d = f"{{${out}, ${out + 1}, ${out + 2}, ${out + 3}}}"
        c = d if j % 2 else f"{{${8 + out}, ${9 + out}, ${10 + out}, ${11 + out}}}"
        for h in range(2):  # pairs 2h, 2h + 1: k columns (2tig, 2tig + 1) and (2tig + 8, 2tig + 9)
            a = f"{{%ra{2 * h}, %rb{2 * h}, %ra{2 * h + 1}, %rb{2 * h + 1}}}"
            ops.append(f"mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {d}, {a}, {{%x{2 * h}, %x{2 * h + 1}}}, "
                       f"{c if h == 0 else d};")
    ops.append("}")
    return "\n".join(ops)


def _diag_asm() -> str:
    """The diagonal of both chains: lane (g, tig) with tig == g // 2 holds row R's sum in C[g][g]
    (chain element g % 2) and R''s in C[g + 8][g] (2 + g % 2); element 0 / 4 out, 0 elsewhere."""
    return "\n".join([
        "{", ".reg .b32 %l, %g, %h;", ".reg .pred %p, %q;", ".reg .f32 %a, %b;",
        "mov.u32 %l, %laneid;", "shr.b32 %g, %l, 2;", "and.b32 %l, %l, 3;", "shr.b32 %h, %g, 1;",
        "setp.eq.u32 %p, %l, %h;", "and.b32 %g, %g, 1;", "setp.eq.u32 %q, %g, 1;",
        *[op for out, c in ((0, 8), (4, 10))  # R: C[g][g] = element g % 2; R': 2 + g % 2; chain A + chain B
          for op in (f"selp.f32 %a, ${c + 1}, ${c}, %q;", f"selp.f32 %b, ${c + 5}, ${c + 4}, %q;",
                     "add.rn.f32 %a, %a, %b;", f"selp.f32 ${out}, %a, 0f00000000, %p;")],
        *[f"mov.f32 ${i}, 0f00000000;" for i in (1, 2, 3, 5, 6, 7)], "}"])


_STEP: tl.constexpr = tl.constexpr(_step_asm())
_DIAG: tl.constexpr = tl.constexpr(_diag_asm())
_STEP_CONSTRAINTS: tl.constexpr = tl.constexpr(",".join(["=f"] * 8 + ["f"] * 8 + ["r"] * 48))
_DIAG_CONSTRAINTS: tl.constexpr = tl.constexpr(",".join(["=f"] * 8 + ["f"] * 8))
#: the sum's factor: w = c * s * 2^-7 in the tensor cores
UNSCALE: tl.constexpr = tl.constexpr(128.0)


@triton.jit
def mma_step(acc, w, sb, x0, x1, x2, x3):
    """One K step: float32 accumulators ``acc`` [BLOCK_N, 32] (mma C fragments) plus words ``w`` times
    their scales (``sb``: the rows' step scales as int32) times x (``x0..x3``: the pairs of each lane's
    words); operands as :func:`_step_asm` lays them out."""
    return tl.inline_asm_elementwise(_STEP, _STEP_CONSTRAINTS, [acc, w, sb, x0, x1, x2, x3],
                                     dtype=tl.float32, is_pure=True, pack=8)


@triton.jit
def mma_rows(acc):
    """float32 [BLOCK_N]: each row's sum (times 2^-7, see ``UNSCALE``) from the accumulators."""
    return tl.sum(tl.inline_asm_elementwise(_DIAG, _DIAG_CONSTRAINTS, [acc], dtype=tl.float32, is_pure=True,
                                            pack=8), axis=1)


@triton.jit
def _mma_loads(w_words, sc_words, x_lane, kw):
    """One K step from word ``kw`` (a multiple of 32), each operand in the word tile's layout (each
    index contiguous in 4s along K, so Triton gives the three loads the words' 16-byte layout and no
    layout change happens in the loop): the words, the rows' 16 scale bytes of the step (every lane
    of a row loads them; L1 serves the repeats) and x's pairs for each lane's words ``j`` = 0..3
    (``x_lane`` is broadcast over the rows: loads of one address)."""
    return _mma_weights(w_words, sc_words, kw) + _mma_x(x_lane, kw)


@triton.jit
def _mma_weights(w_words, sc_words, kw):
    """The words and scales of :func:`_mma_loads`."""
    return tl.load(w_words + kw), tl.load(sc_words + kw // 8)


@triton.jit
def _mma_x(x_lane, kw):
    """x's pairs of :func:`_mma_loads`."""
    x = x_lane + 4 * kw
    return tl.load(x), tl.load(x + 4), tl.load(x + 8), tl.load(x + 12)


@triton.jit
def fp4_mma_rows(w_ptr, s_ptr, x_ptr, rows, k_start, k_end, K: tl.constexpr, BLOCK_N: tl.constexpr,
                 BLOCK_K: tl.constexpr, PDL: tl.constexpr):
    """float32 [BLOCK_N]: ``sum_k c[row, k] * s[row, k // 16] * x[k]`` over ``[k_start, k_end)`` (multiples
    of 256) for the int32 word view ``w_ptr`` ([N, K / 8]), the int32 view of the e4m3 scale bytes
    ``s_ptr`` ([N, K / 64]) and x's int32 pair view ``x_ptr`` ([K / 2], bf16). Loads double-buffered
    in registers, as the plain GEMV's. The first step's weights are requested before waiting on the
    kernel before (:func:`vtcore.kernels.pdl.wait_prior`, ``PDL``): weights are no kernel's output."""
    BLOCK_KW: tl.constexpr = BLOCK_K // 8
    rows64 = rows.to(tl.int64)
    wi = tl.arange(0, BLOCK_KW)
    w_words = w_ptr + rows64[:, None] * (K // 8) + wi[None, :]
    sc_words = s_ptr + rows64[:, None] * (K // 64) + (wi % 4)[None, :]
    x_lane = x_ptr + tl.broadcast_to((16 * (wi // 4) + wi % 4)[None, :], (BLOCK_N, BLOCK_KW))
    acc = tl.zeros((BLOCK_N, BLOCK_KW), dtype=tl.float32)
    kw0 = k_start // 8
    steps = (k_end - k_start) // BLOCK_K
    # Two register buffers used in turn (unrolled by two): each step's loads are issued a step before
    # use. Written as one buffer carried through the loop, ptxas sank the loads to the loop's end.
    w, sb = _mma_weights(w_words, sc_words, kw0)
    wait_prior(PDL)
    x0, x1, x2, x3 = _mma_x(x_lane, kw0)
    for i in range(0, steps // 2):
        bw, bsb, bx0, bx1, bx2, bx3 = _mma_loads(w_words, sc_words, x_lane, kw0 + (2 * i + 1) * BLOCK_KW)
        acc = mma_step(acc, w, sb, x0, x1, x2, x3)
        w, sb, x0, x1, x2, x3 = _mma_loads(w_words, sc_words, x_lane, kw0 + tl.minimum(2 * i + 2, steps - 1) * BLOCK_KW)
        acc = mma_step(acc, bw, bsb, bx0, bx1, bx2, bx3)
    if steps % 2 == 1:
        acc = mma_step(acc, w, sb, x0, x1, x2, x3)
    return mma_rows(acc) * UNSCALE
