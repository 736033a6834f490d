#!/usr/bin/env bash
# Programmatic dependent launch (vtcore.kernels.pdl) on one GPU, in one run: the CUDA tests with it
# on, then NVFP4 and bf16 Qwen3-4B TPOT at batch 1 from `vtcore bench` with it off (VTCORE_PDL=0, the
# peer) and on, then decode attention (scripts/bench_attention.py) off and on.
#   bash scripts/gpu_pdl_check.sh OUTDIR   (after installing vtcore, plugins/qwen3_dense and plugins/quant_nvfp4)
set -uo pipefail
out=${1:?usage: gpu_pdl_check.sh OUTDIR}
mkdir -p "$out"
python3 -m pytest -q -x tests/test_kernels_gemv.py tests/test_kernels_gemv_fp4.py tests/test_kernels_attention.py \
    tests/test_kernels_elementwise.py tests/test_kernels_qk_rope_epilogue.py tests/test_fused_decode_path.py \
    tests/test_gpu_decode.py tests/test_decode_graph_path.py \
    2>&1 | tail -5 | tee "$out/cuda_tests.txt"
shapes=$(mktemp -d)
python3 scripts/model_shapes.py "$shapes" >/dev/null
for pdl in 0 1; do
  for shape in qwen3-4b-nvfp4 qwen3-4b; do
    VTCORE_PDL=$pdl vtcore bench --model "$shapes/$shape" --load-format dummy --dtype bfloat16 --input-len 1024 \
        --output-len 64 --concurrency 1 --no-progress --json "$out/bench-$shape-pdl$pdl.json" 2>&1 \
        | grep -v -i -e warn -e "^ *$" | grep -e "^ *1 " -e roofline
  done
done
VTCORE_PDL=0 python3 scripts/bench_attention.py --out "$out" 2>&1 | grep -v -i warn
VTCORE_PDL=1 python3 scripts/bench_attention.py 2>&1 | grep -v -i warn
