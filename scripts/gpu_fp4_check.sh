#!/usr/bin/env bash
# Issue 9's FP4 work on one GPU, in one run: the CUDA tests of the decode GEMV (tensor cores, register
# cap, SwiGLU epilogue), its bandwidth beside copy (scripts/bench_gemv.py --fp4), and NVFP4 vs bf16
# Qwen3-4B TPOT at batch 1 from `vtcore bench` (same run, roofline measured in it).
#   bash scripts/gpu_fp4_check.sh OUTDIR   (after installing vtcore, plugins/qwen3_dense and plugins/quant_nvfp4)
set -uo pipefail
out=${1:?usage: gpu_fp4_check.sh OUTDIR}
mkdir -p "$out"
python3 -m pytest -q -x tests/test_kernels_gemv_fp4.py tests/test_kernels_gemv.py tests/test_fused_decode_path.py \
    2>&1 | tail -5 | tee "$out/cuda_tests.txt"
python3 scripts/bench_gemv.py --fp4 --out "$out" 2>&1 | grep -v -i warn
shapes=$(mktemp -d)
python3 scripts/model_shapes.py "$shapes" >/dev/null
for shape in qwen3-4b-nvfp4 qwen3-4b; do
  vtcore bench --model "$shapes/$shape" --load-format dummy --dtype bfloat16 --input-len 1024 --output-len 64 \
      --concurrency 1 --no-progress --json "$out/bench-$shape.json" 2>&1 | grep -v -i -e warn -e "^ *$"
done
