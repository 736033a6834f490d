"""NVFP4 decode GEMV on tensor cores: packed FP4 codes decoded to bf16 pairs and summed by ``mma``.

The one-row FP4 GEMV (:mod:`vtcore.kernels.gemv`) is bound by instruction issue and load latency, not
DRAM bandwidth: a float32 decode costs three integer ops and an FMA a code. Here (CUDA, sm_89+, bf16
x, e4m3 group-16 scales: NVFP4) the decode is Marlin-style packed 16-bit work in inline PTX, and the
multiply-adds go to the tensor cores:

* A word ``q`` of 8 codes (code ``j`` in nibble ``j``) gives four bf16x2 registers, pair ``n`` holding
  codes ``n`` and ``n + 4``: the magnitude bits ``e e m`` at bf16 bits 8..6 and the sign at bit 15 of
  each half (``c * 2^-126``, the e == 0 codes as bf16 subnormals); three ops a pair (mask, a multiply
  that adds two shifted copies, mask: :func:`_pairs`).
* The group's e4m3 scale, converted by the hardware (``cvt.rn.f16x2.e4m3x2``, sm_89+) and times 2^119
  (a normal bf16 for every e4m3 value), multiplies each pair (``fma.rn.bf16x2``): ``w = c * s * 2^-7``,
  exact in bf16 (<= 6 significant bits) and normal.
* ``mma.m16n8k16`` with the weights as A: a thread's pairs of two weight rows R, R' (the same words)
  go in as A's two row halves, x's matching bf16 pairs (a byte permute of the loaded words) as B's
  column ``groupID``. Row ``groupID`` of the product, column ``groupID`` (the diagonal), is R's sum
  over the codes its lane quad holds; the other 7 columns are cross terms and are dropped. The
  accumulator carries the diagonal over all K steps.

Both layouts take 256 codes (32 int32 words) a row a K step, in Triton's register layout of the
``[BLOCK_N, 32]`` word tile, row repetitions in consecutive registers (``pack=8``):

* wide: 4 words a lane (one 16-byte load), 8 lanes a row, 2 rows a thread (R, R' = R + 4 * warps);
  x's pairs cost 64 bytes a lane a step, twice the weights;
* narrow: 2 words a lane (one group; 8-byte loads, got by a word order contiguous in 2s only),
  16 lanes a row, 4 rows a thread (2 * warps apart: two mma row pairs sharing x), so x
  costs 32 bytes a lane a step, as much as the weights. ``gemv`` takes it for whole-K launches of 4
  row repetitions (:func:`vtcore.kernels.gemv.narrow_layout`).

The loop is bound by load latency through L1, x's loads most of it (design.md, "Decode launches";
profiles and timings in docs/BENCHMARKS.md), so what it loads counts more than its instructions: the
scale bytes are loaded once a lane by inline PTX (2 bytes wide, 1 narrow, instead of the row's 16),
and the narrow layout halves x's bytes. x, scales and words share the tile's layout (scales and x
follow the words' load: Triton changes no layout inside the loop; loaded in another layout, the tile
would move through shared memory every step). The host only launches tiles where the layout holds
(:func:`layout_ok`, and 16-byte aligned operands: with less, Triton picks another layout); the GPU
tests pin every code to its row and column in both layouts and check the sums against the float64
reference. Left to choose, ptxas issues each step's loads late, whatever the source order, to save
registers: the launch caps them (``vtcore.kernels.gemv._registers``). The interpreter cannot run
inline PTX: CPU tests cover the plain decode GEMV and emulate the decode's PTX.
"""
from __future__ import annotations

import triton
import triton.language as tl

from vtcore.kernels.pdl import wait_prior

__all__ = ["layout_ok", "fp4_mma_rows"]

_MASK_PAIR = "0x81C081C0"  # bf16 bits 6..8 and 15 of both halves


def layout_ok(block_n: int, block_kw: int, num_warps: int) -> bool:
    """Whether a ``[block_n, block_kw]`` int32 word tile over ``num_warps`` warps has a layout the PTX
    assumes: 32 words (256 codes) a K step and whole packs of row repetitions; wide, 8 lanes a row with
    4 words each and rows R, R' a pack; narrow (whole packs of 4 rows: the caller picks it only at
    ``block_n == 8 * num_warps``), 16 lanes a row with 2 words each. A lane quad shares a row in both."""
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


def _step_asm(narrow: bool) -> str:
    """One K step (256 codes) of one thread's rows, in the wide or the narrow layout (see the module
    docstring).

    Operands: ``$0..$7`` accumulators out, two mma C fragments (``$0..$3``, ``$4..$7``); ``$8..$15`` the
    accumulators in; ``$16..$23`` the words; ``$24..$31`` the scales; ``$32..$63`` x's int32 bf16 pairs
    (x columns ``8w + 2i``, ``8w + 2i + 1`` of word ``w``'s pair ``i``).

    * Wide: element ``e`` of ``$16..$23`` is word ``e`` of row R (``e < 4``) or word ``e - 4`` of R'; each
      row's e4m3 bytes of groups ``2t, 2t + 1`` (its words 0, 1 and 2, 3) in ``$24`` (R) and ``$28`` (R');
      ``$32 + 8j + i`` is pair ``i`` of word ``j``; fragment 0 sums words 0, 1, fragment 1 words 2, 3.
    * Narrow: element ``2q + e`` of ``$16..$23`` is word ``e`` of row ``q`` (rows 0, 1 and 2, 3 the two
      mma row pairs); row ``q``'s group byte in ``$24 + 2q``; ``$32 + 8i + e`` is pair ``i`` of word ``e``;
      fragment ``p`` sums row pair ``p``."""
    ops = ["{", ".reg .b32 %m, %h, %z, %c119, %v;", ".reg .b16 %sb, %h0, %h1;", ".reg .f32 %f0, %f1;",
           f".reg .b32 %sa<2>, {'' if narrow else '%sr<2>, '}%ra<4>, %rb<4>, %x<16>;", "mov.b32 %z, 0x80008000;",
           "mov.b32 %c119, 0x7B007B00;"]  # bf16x2 (2^119, 2^119)
    words = 2 if narrow else 4
    for j in range(words):  # word j's B fragments (x[8w+i], x[8w+i+4]) for code pairs i, i + 4, shared by the rows
        v = [f"${32 + 8 * i + j}" if narrow else f"${32 + 8 * j + i}" for i in range(4)]
        ops += [f"prmt.b32 %x{4 * j}, {v[0]}, {v[2]}, 0x5410;", f"prmt.b32 %x{4 * j + 1}, {v[0]}, {v[2]}, 0x7632;",
                f"prmt.b32 %x{4 * j + 2}, {v[1]}, {v[3]}, 0x5410;", f"prmt.b32 %x{4 * j + 3}, {v[1]}, {v[3]}, 0x7632;"]
    if narrow:  # per row pair: its two scale bytes converted at once; words (R, R', R's scale, R''s, word, fragment)
        pairs = [([f"prmt.b32 %v, ${24 + 4 * p}, ${26 + 4 * p}, 0x0040;", *_scales("%v", "%sa")],
                  [(16 + 4 * p + e, 18 + 4 * p + e, "%sa0", "%sa1", e, 4 * p) for e in range(2)]) for p in range(2)]
    else:
        pairs = [([*_scales("$24", "%sa"), *_scales("$28", "%sr")],
                  [(16 + j, 20 + j, f"%sa{j // 2}", f"%sr{j // 2}", j, 4 * (j // 2)) for j in range(4)])]
    started = set()
    for setup, row_words in pairs:
        ops += setup
        for r, r2, s, s2, j, frag in row_words:
            ops += _pairs(f"${r}", "%ra") + _pairs(f"${r2}", "%rb")
            ops += [f"fma.rn.bf16x2 %ra{n}, %ra{n}, {s}, %z;" for n in range(4)]
            ops += [f"fma.rn.bf16x2 %rb{n}, %rb{n}, {s2}, %z;" for n in range(4)]
            d = f"{{${frag}, ${frag + 1}, ${frag + 2}, ${frag + 3}}}"
            for h in range(2):  # pairs 2h, 2h + 1: k columns (2tig, 2tig + 1) and (2tig + 8, 2tig + 9)
                c = d if frag in started else f"{{${8 + frag}, ${9 + frag}, ${10 + frag}, ${11 + frag}}}"
                started.add(frag)
                a = f"{{%ra{2 * h}, %rb{2 * h}, %ra{2 * h + 1}, %rb{2 * h + 1}}}"
                ops.append(f"mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {d}, {a}, "
                           f"{{%x{4 * j + 2 * h}, %x{4 * j + 2 * h + 1}}}, {c};")
    ops.append("}")
    return "\n".join(ops)


def _diag_asm(narrow: bool) -> str:
    """The rows' sums from the fragments' diagonals: lane (g, tig) with tig == g // 2 holds a fragment's
    C[g][g] (element g % 2: its row R) and C[g + 8][g] (2 + g % 2: R'). Wide: R's (the sum of both
    fragments) into element 0, R''s into 4; narrow: row q's into element 2q; 0 elsewhere."""
    sums = [(0, (8,)), (2, (10,)), (4, (12,)), (6, (14,))] if narrow else [(0, (8, 12)), (4, (10, 14))]
    ops = ["{", ".reg .b32 %l, %g, %h;", ".reg .pred %p, %q;", ".reg .f32 %a, %b;",
           "mov.u32 %l, %laneid;", "shr.b32 %g, %l, 2;", "and.b32 %l, %l, 3;", "shr.b32 %h, %g, 1;",
           "setp.eq.u32 %p, %l, %h;", "and.b32 %g, %g, 1;", "setp.eq.u32 %q, %g, 1;"]
    for out, frags in sums:
        ops.append(f"selp.f32 %a, ${frags[0] + 1}, ${frags[0]}, %q;")
        for c in frags[1:]:
            ops += [f"selp.f32 %b, ${c + 1}, ${c}, %q;", "add.rn.f32 %a, %a, %b;"]
        ops.append(f"selp.f32 ${out}, %a, 0f00000000, %p;")
    ops += [f"mov.f32 ${i}, 0f00000000;" for i in range(8) if i not in dict(sums)]
    return "\n".join(ops + ["}"])


_STEP_WIDE: tl.constexpr = tl.constexpr(_step_asm(False))
_STEP_NARROW: tl.constexpr = tl.constexpr(_step_asm(True))
_DIAG_WIDE: tl.constexpr = tl.constexpr(_diag_asm(False))
_DIAG_NARROW: tl.constexpr = tl.constexpr(_diag_asm(True))
_STEP_CONSTRAINTS: tl.constexpr = tl.constexpr(",".join(["=f"] * 8 + ["f"] * 8 + ["r"] * 48))
_DIAG_CONSTRAINTS: tl.constexpr = tl.constexpr(",".join(["=f"] * 8 + ["f"] * 8))


def _lane_load(ld: str, elements: int) -> str:
    """PTX: one load (``ld``, e.g. ``ld.global.nc.u16``) at element 0's address, the value copied to
    all ``elements`` of the lane (their addresses are equal)."""
    return " ".join([f"{ld} $0, [${elements}];", *(f"mov.b32 ${i}, $0;" for i in range(1, elements))])


_SCALES_WIDE: tl.constexpr = tl.constexpr(_lane_load("ld.global.nc.u16", 4))  # the lane's 2 group bytes
_SCALES_NARROW: tl.constexpr = tl.constexpr(_lane_load("ld.global.nc.u8", 2))  # the lane's group byte
_LANE_CONSTRAINTS_WIDE: tl.constexpr = tl.constexpr(",".join(["=r"] * 4 + ["l"] * 4))
_LANE_CONSTRAINTS_NARROW: tl.constexpr = tl.constexpr(",".join(["=r"] * 2 + ["l"] * 2))
#: the sum's factor: w = c * s * 2^-7 in the tensor cores
UNSCALE: tl.constexpr = tl.constexpr(128.0)


@triton.jit
def mma_step(acc, w, sb, x0, x1, x2, x3, NARROW: tl.constexpr):
    """One K step: float32 accumulators ``acc`` [BLOCK_N, 32] (mma C fragments) plus words ``w`` times
    their group scales (``sb``, int32: each lane's e4m3 bytes) times x (``x0..x3``, int32 bf16 pairs);
    operands as :func:`_step_asm` lays them out."""
    return tl.inline_asm_elementwise(_STEP_NARROW if NARROW else _STEP_WIDE, _STEP_CONSTRAINTS,
                                     [acc, w, sb, x0, x1, x2, x3], dtype=tl.float32, is_pure=True, pack=8)


@triton.jit
def mma_rows(acc, NARROW: tl.constexpr):
    """float32 [BLOCK_N]: each row's sum (times 2^-7, see ``UNSCALE``) from the accumulators."""
    return tl.sum(tl.inline_asm_elementwise(_DIAG_NARROW if NARROW else _DIAG_WIDE, _DIAG_CONSTRAINTS, [acc],
                                            dtype=tl.float32, is_pure=True, pack=8), axis=1)


@triton.jit
def _lane_ptrs(w_ptr, s_ptr, x_ptr, rows, K: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_KW: tl.constexpr,
               NARROW: tl.constexpr):
    """Step 0's pointers, in the word tile's layout: the words, each lane's scale bytes (the same
    address in all of a lane's elements) and x's int32 pairs (broadcast over the rows). Wide: lane t
    (of 8 a row) reads words 4t..4t+3 (indices contiguous in 4s: 16-byte loads), groups 2t, 2t + 1.
    Narrow: lane u (of 16) reads words 2g, 2g + 1, one group g = 5u mod 16 (contiguous in 2s only, so
    that Triton gives the tile 8-byte loads: 2 words a lane, 4 rows a thread)."""
    c = tl.arange(0, BLOCK_KW)
    if NARROW:
        grp = (c // 2) * 5 % 16
        word = c % 2 + 2 * grp
        byte = grp
        xoff = 4 * word
    else:
        word = c
        byte = 2 * (c // 4)
        xoff = 16 * (c // 4) + c % 4
    rows64 = rows.to(tl.int64)[:, None]
    return (w_ptr + rows64 * (K // 8) + word[None, :], s_ptr + rows64 * (K // 16) + byte[None, :],
            x_ptr + tl.broadcast_to(xoff[None, :], (BLOCK_N, BLOCK_KW)))


@triton.jit
def _mma_weights(w_words, sc, kw, NARROW: tl.constexpr):
    """The words and scale bytes of the step from word ``kw`` (a multiple of 32). The scales are
    loaded by inline PTX once a lane (``tl.load`` would load each element, and the bytes' repacking
    for the asm cost more PRMTs than the loads saved): 2 bytes (wide) or 1 (narrow) a row, not the
    row's 16 of the step (docs/BENCHMARKS.md)."""
    sp = sc + kw // 2
    if NARROW:
        sb = tl.inline_asm_elementwise(_SCALES_NARROW, _LANE_CONSTRAINTS_NARROW, [sp], dtype=tl.int32, is_pure=True,
                                       pack=2)
    else:
        sb = tl.inline_asm_elementwise(_SCALES_WIDE, _LANE_CONSTRAINTS_WIDE, [sp], dtype=tl.int32, is_pure=True, pack=4)
    return tl.load(w_words + kw), sb


@triton.jit
def _after_wait():
    """int32 0 from inline asm with side effects: called after :func:`wait_prior` and added to x's
    pointers, it orders the narrow layout's x loads (pure inline PTX, which the compiler may
    otherwise move) after the wait on the kernel that wrote x."""
    return tl.inline_asm_elementwise("mov.b32 $0, 0;", "=r", [], dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def _mma_x(x_lane, kw, NARROW: tl.constexpr):
    """x's pairs for the step from word ``kw``, as the step asm takes them: wide, ``x_j`` holds word j's
    4 pairs (4 loads); narrow, ``x_i`` holds pair i of the lane's 2 words (two 16-byte loads, PTX;
    ``x_lane`` carries :func:`_after_wait`)."""
    x = x_lane + 4 * kw
    if NARROW:
        x0, x1, x2, x3 = tl.inline_asm_elementwise(
            "ld.global.nc.v4.b32 {$0, $2, $4, $6}, [$8]; ld.global.nc.v4.b32 {$1, $3, $5, $7}, [$9];",
            "=r,=r,=r,=r,=r,=r,=r,=r,l,l", [x], dtype=(tl.int32, tl.int32, tl.int32, tl.int32), is_pure=True, pack=2)
    else:
        x0, x1, x2, x3 = tl.load(x), tl.load(x + 4), tl.load(x + 8), tl.load(x + 12)
    return x0, x1, x2, x3


@triton.jit
def fp4_mma_rows(w_ptr, s_ptr, x_ptr, rows, k_start, k_end, K: tl.constexpr, BLOCK_N: tl.constexpr,
                 BLOCK_K: tl.constexpr, NARROW: tl.constexpr, PDL: tl.constexpr):
    """float32 [BLOCK_N]: ``sum_k c[row, k] * s[row, k // 16] * x[k]`` over ``[k_start, k_end)`` (multiples
    of 256) for the int32 word view ``w_ptr`` ([N, K / 8]), the e4m3 scale bytes ``s_ptr`` ([N, K / 16])
    and x's int32 pair view ``x_ptr`` ([K / 2], bf16), in the narrow or the wide layout. Loads
    double-buffered in registers, as the plain GEMV's. The first step's weights are requested before
    waiting on the kernel before (:func:`vtcore.kernels.pdl.wait_prior`, ``PDL``): weights are no
    kernel's output."""
    BLOCK_KW: tl.constexpr = BLOCK_K // 8
    w_words, sc, x_lane = _lane_ptrs(w_ptr, s_ptr, x_ptr, rows, K, BLOCK_N, BLOCK_KW, NARROW)
    acc = tl.zeros((BLOCK_N, BLOCK_KW), dtype=tl.float32)
    kw0 = k_start // 8
    steps = (k_end - k_start) // BLOCK_K
    # Two register buffers used in turn (unrolled by two): each step's loads are issued a step before
    # use. Written as one buffer carried through the loop, ptxas sank the loads to the loop's end.
    w, sb = _mma_weights(w_words, sc, kw0, NARROW)
    wait_prior(PDL)
    if NARROW:
        x_lane += _after_wait()
    x0, x1, x2, x3 = _mma_x(x_lane, kw0, NARROW)
    for i in range(0, steps // 2):
        kb = kw0 + (2 * i + 1) * BLOCK_KW
        bw, bsb = _mma_weights(w_words, sc, kb, NARROW)
        bx0, bx1, bx2, bx3 = _mma_x(x_lane, kb, NARROW)
        acc = mma_step(acc, w, sb, x0, x1, x2, x3, NARROW)
        kn = kw0 + tl.minimum(2 * i + 2, steps - 1) * BLOCK_KW
        w, sb = _mma_weights(w_words, sc, kn, NARROW)
        x0, x1, x2, x3 = _mma_x(x_lane, kn, NARROW)
        acc = mma_step(acc, bw, bsb, bx0, bx1, bx2, bx3, NARROW)
    if steps % 2 == 1:
        acc = mma_step(acc, w, sb, x0, x1, x2, x3, NARROW)
    return mma_rows(acc, NARROW) * UNSCALE
