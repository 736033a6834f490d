#!/usr/bin/env bash
# Prefill on one GPU (docs/BENCHMARKS.md): TTFT at concurrency 1 for a 1024-token prompt (Qwen3-0.6B and
# Qwen3-4B shapes, dummy bf16 weights), and a 2048-token shared prefix before 128 new tokens on Qwen3-4B
# with prefix caching off and on (a hit leaves a 128-token chunk alone in its step: the padded chunk path);
# an 8192-token prompt on Qwen3-4B in one step and in 2048-token chunks. Each run reports its prompt's compute
# floor at the matmul rate it measured (the "prefill floor" line).
#   bash scripts/bench_prefill.sh OUTDIR   (vtcore and plugins/qwen3_dense installed)
set -uo pipefail
out=${1:?usage: bench_prefill.sh OUTDIR}
shapes=$(mktemp -d)
python3 scripts/model_shapes.py "$shapes" >/dev/null
common=(--load-format dummy --dtype bfloat16 --no-progress)
b() { local name=$1 limit=$2; shift 2; echo "== $name: vtcore bench $*"
      timeout "$limit" vtcore bench "$@" --json "$out/$name.json" 2>&1 | grep -v -i -e warn -e "^ *$" -e External
      echo "($name: rc ${PIPESTATUS[0]})"; }
for shape in qwen3-0.6b qwen3-4b; do
    b "$shape-ttft1024" 90 --model "$shapes/$shape" "${common[@]}" --concurrency 1 --input-len 1024 \
        --output-len 32 --num-prompts 8
done
b qwen3-4b-prefix2048 110 --model "$shapes/qwen3-4b" "${common[@]}" --compare-prefix-caching --prefix-len 2048 \
    --input-len 128 --output-len 32 --concurrency 1 --num-prompts 8
for chunk in 8192 2048; do
    b qwen3-4b-ttft8192-chunk$chunk 150 --model "$shapes/qwen3-4b" "${common[@]}" --concurrency 1 --input-len 8192 \
        --output-len 16 --num-prompts 4 --max-num-batched-tokens $chunk
done
