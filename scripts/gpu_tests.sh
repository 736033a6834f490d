#!/usr/bin/env bash
# Every CUDA test of the decode path on one GPU (the kernels, the fused launches, graphs, async vs
# sync), each file run to the end (no -x), with the slowest listed:
#   bash scripts/gpu_tests.sh OUTDIR   (after installing vtcore, plugins/qwen3_dense and plugins/quant_nvfp4)
set -uo pipefail
out=${1:?usage: gpu_tests.sh OUTDIR}
mkdir -p "$out"
python3 -m pytest -q -rf --durations=5 tests/test_kernels_gemv.py tests/test_kernels_gemv_fp4.py \
    tests/test_kernels_attention.py tests/test_kernels_elementwise.py tests/test_kernels_qk_rope_epilogue.py \
    tests/test_fused_decode_path.py tests/test_gpu_decode.py tests/test_decode_graph_path.py \
    2>&1 | grep -v "Warning" | tail -25 | tee "$out/cuda_tests.txt"
