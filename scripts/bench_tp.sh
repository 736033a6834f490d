#!/usr/bin/env bash
# Tensor parallelism on two GPUs of one host (issue 25; docs/BENCHMARKS.md), NCCL with NVLink multicast off:
#   1. the conformance gate with --device cuda --tensor-parallel-size 2 (every family; FP4 checkpoints too);
#   2. Qwen3-4B shape, bf16, batch 1: TPOT at TP=1, then TP=2 (one call of this script);
#   3. Qwen3.5-35B-A3B shape, bf16 and NVFP4A16: TPOT at batch 1 and output throughput at concurrency 16,
#      TP=1 beside TP=2, with the collectives' device time a decode step (NCCL kernels, rank 0's profile).
#   bash scripts/bench_tp.sh OUTDIR   (vtcore and every plugin installed)
set -uo pipefail
out=${1:?usage: bench_tp.sh OUTDIR}
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1  # the machine's rule
shapes=$(mktemp -d)
python3 scripts/model_shapes.py "$shapes" >/dev/null
quiet() { grep -v -i -e warn -e "^ *$" -e External -e "^\[transformers\]"; }
echo "== vtcore conformance --device cuda --tensor-parallel-size 2"
timeout 900 vtcore conformance --device cuda --tensor-parallel-size 2 --json "$out/conformance-tp2.json" 2>&1 \
    | quiet | tail -n 20
bench() {  # name tp concurrency output-len
    echo "== $1 TP=$2: vtcore bench --concurrency $3"
    timeout 600 vtcore bench --model "$shapes/$1" --load-format dummy --dtype bfloat16 --no-progress \
        --tensor-parallel-size "$2" --concurrency "$3" --input-len 1024 --output-len "$4" \
        --json "$out/bench-$1-tp$2.json" 2>&1 | quiet | tail -n 12
    echo "(rc ${PIPESTATUS[0]})"
}
for tp in 1 2; do bench qwen3-4b "$tp" 1 128; done
for name in qwen3.5-35b-a3b qwen3.5-35b-a3b-nvfp4; do
    for tp in 1 2; do bench "$name" "$tp" 1,16 128; done
done
