"""Where ptxas puts the tensor-core FP4 GEMV's loads: compiled for sm_90 here, no GPU needed.

    python scripts/sass_fp4_mma.py [--sms 132]

For each NVFP4 Qwen3-4B decode shape, the launch ``gemv`` picks (``_config``) is compiled with Triton's
bundled ptxas twice: with the register cap ``_registers`` gives and with none (ptxas's choice).
Printed: registers, spill bytes, the main loop's SASS instructions a K step (where the loop is not
unrolled away) and how far ahead of their first use the weight loads are issued (median over the
loads, in SASS instructions and, in a loop, in K steps). A load is a weight load when its first
user decodes it (not a PRMT: x's pairs or the narrow layout's scale bytes; not an F2FP: the wide
layout's scale bytes). The loop is latency-bound (docs/BENCHMARKS.md), so the lookahead is what the
cap buys.
"""
from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import tempfile

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from vtcore.kernels.gemv import _config, _gemv_kernel, _registers, narrow_layout

SHAPES = {"4b gate_up": (19456, 2560), "4b down": (2560, 9728), "4b qkv": (6144, 2560), "4b o": (2560, 4096)}
_POINTERS = {"x_ptr": "*i32", "r_ptr": "*bf16", "nw_ptr": "*i32", "r_out_ptr": "*bf16", "w_ptr": "*i32",
             "s_ptr": "*u8", "g_ptr": "*fp32", "b_ptr": "*i32", "out_ptr": "*bf16", "ws_ptr": "*fp32", "sem_ptr": "*i32",
             "pos_ptr": "*i64", "cos_ptr": "*fp32", "sin_ptr": "*fp32", "qw_ptr": "*bf16", "kw_ptr": "*bf16",
             "kc_ptr": "*bf16", "vc_ptr": "*bf16", "slot_ptr": "*i64"}
_BIN = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")


def compile_launch(n: int, k: int, sms: int, maxnreg: int | None) -> bytes:
    """The sm_90 cubin of gemv's tensor-core launch for an [n, k] NVFP4 weight (16-byte aligned operands)."""
    _, bn, bk, split, k_split, warps, stages, full = _config(1, n, k, 4, sms, *[None] * 5, True)
    const = dict(N=n, K=k, K_P2=triton.next_power_of_2(k), K_SPLIT=k_split, SPLIT=split, FULL_TILES=full, BLOCK_M=1, BLOCK_N=bn,
                 BLOCK_K=bk, EVEN_N=n % bn == 0, EVEN_K=k % bk == 0, HAS_BIAS=False, PROLOGUE=0, HAS_RESIDUAL=False,
                 ZERO_CENTERED=False, FP4=True, FP4_MMA=True, FP4_NARROW=narrow_layout(bn, split, warps), GROUP=16, SCALE_E8M0=False, HAS_GLOBAL=True,
                 SWIGLU=False, ROPE=False, NQ=0, NKV=0, QK_NORM=False, QK_ZERO_CENTERED=False,
                 DOT_PRECISION="tf32", INTERPRET=False, PDL=True)
    sig = {**_POINTERS, "M": "i32", "stride_xm": "i32", "stride_rm": "i32", "eps": "fp32", "stride_cos": "i32",
           "stride_ct": "i32", "stride_ch": "i32", "qk_eps": "fp32", **{c: "constexpr" for c in const}}
    names = list(sig)
    src = ASTSource(_gemv_kernel, sig, constexprs={(names.index(c),): v for c, v in const.items()},
                    attrs={(i,): [["tt.divisibility", 16]] for i in range(len(_POINTERS))})
    options = dict(num_warps=warps, num_stages=stages, enable_fp_fusion=True, **({"maxnreg": maxnreg} if maxnreg else {}))
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=options).asm["cubin"]


def _tool(name: str, cubin: bytes, *args: str) -> str:
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        return subprocess.run([os.path.join(_BIN, name), *args, f.name], capture_output=True, text=True,
                              check=True).stdout


def sass_report(cubin: bytes) -> dict:
    """Registers, spills, loop instructions a K step and the weight loads' lookahead of one cubin."""
    usage = _tool("cuobjdump", cubin, "-res-usage")
    ins = [(int(m[1], 16), m[2].strip()) for m in
           (re.match(r"\s+/\*([0-9a-f]{4})\*/\s+(.*?);", line) for line in _tool("cuobjdump", cubin, "-sass").splitlines())
           if m]
    back = [(a - int(m[1], 16), int(m[1], 16), a) for a, t in ins for m in [re.search(r"BRA (0x[0-9a-f]+)", t)]
            if m and int(m[1], 16) < a]
    if back:  # the main loop: the longest backward branch; distances wrap around it
        _, lo, hi = max(back)
        body = [t for a, t in ins if lo <= a <= hi]
    else:
        body = [t for _, t in ins]
    n, ahead = len(body), []
    for i, t in enumerate(body):
        m = re.search(r"LDG\S*\s+R(\d+)", t)
        if not m:
            continue
        regs = {f"R{int(m[1]) + j}" for j in range(4 if ".128" in t else 1)}
        for d in range(1, n if back else n - i):
            ops = re.split(r"[ ,\[\]]+", re.sub(r"^@!?U?P[T0-9]+\s+", "", body[(i + d) % n]))  # predicate off
            if {o.split(".")[0] for o in ops[2:]} & regs:
                if not ops[0].startswith(("PRMT", "F2FP")):
                    ahead.append(d)
                break
    steps = sum("HMMA" in t for t in body) / 8 if back else 0  # 8 mma a 256-code step of a pack (2 rows wide, 4 narrow)
    out = {"regs": int(re.search(r"REG:(\d+)", usage)[1]), "spill_bytes": int(re.search(r"LOCAL:(\d+)", usage)[1]),
           "weight_lookahead": statistics.median(ahead) if ahead else None}
    if back:
        out["loop_per_step"] = n / steps
        out["lookahead_steps"] = out["weight_lookahead"] / out["loop_per_step"]
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sms", type=int, default=132, help="SM count the launch configs are made for (H200: 132)")
    args = ap.parse_args()
    for name, (n, k) in SHAPES.items():
        _, bn, _, split, _, warps, _, _ = _config(1, n, k, 4, args.sms, *[None] * 5, True)
        cap = _registers(triton.cdiv(n, bn) * split, args.sms, warps)
        for label, regs in (("capped", cap), ("ptxas", None)):
            r = sass_report(compile_launch(n, k, args.sms, regs))
            steps = f"  loop {r['loop_per_step']:.0f} a step, {r['lookahead_steps']:.2f} steps" if "loop_per_step" in r else ""
            print(f"{name:11s} {bn:3d} rows split {split:2d} {label:6s} cap {regs}: {r['regs']:3d} registers, "
                  f"{r['spill_bytes']} B spilled, weight loads {r['weight_lookahead']} instructions ahead{steps}")


if __name__ == "__main__":
    main()
