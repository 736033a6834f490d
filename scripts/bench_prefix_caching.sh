#!/usr/bin/env bash
# Prefix caching on one GPU (docs/BENCHMARKS.md): caching off and on in the same call, fresh engines,
# dummy weights of the real shapes. A 2048-token shared prefix before 128 new tokens at concurrency 1
# (Qwen3-4B, Qwen3.5-35B-A3B: its Gated DeltaNet layers resume from state snapshots), and no sharing
# (random 1024/128 at concurrency 32, Qwen3-4B) for what caching costs when nothing hits.
#   bash scripts/bench_prefix_caching.sh OUTDIR   (vtcore, plugins/qwen3_dense and plugins/qwen3_5 installed)
set -uo pipefail
out=${1:?usage: bench_prefix_caching.sh OUTDIR}
shapes=$(mktemp -d)
python3 scripts/model_shapes.py "$shapes" >/dev/null
common=(--load-format dummy --dtype bfloat16 --no-progress --compare-prefix-caching)
b() { local name=$1 limit=$2; shift 2; echo "== $name: vtcore bench $*"
      timeout "$limit" vtcore bench "$@" --json "$out/$name.json" 2>&1 | grep -v -i -e warn -e "^ *$" -e External
      echo "($name: rc ${PIPESTATUS[0]})"; }
b qwen3.5-35b-a3b-prefix2048 230 --model "$shapes/qwen3.5-35b-a3b" "${common[@]}" --prefix-len 2048 \
    --input-len 128 --output-len 32 --concurrency 1 --num-prompts 8
b qwen3-4b-prefix2048 110 --model "$shapes/qwen3-4b" "${common[@]}" --prefix-len 2048 --input-len 128 \
    --output-len 32 --concurrency 1 --num-prompts 8
b qwen3-4b-nosharing 110 --model "$shapes/qwen3-4b" "${common[@]}" --input-len 1024 --output-len 128 \
    --concurrency 32
