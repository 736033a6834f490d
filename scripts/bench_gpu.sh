#!/usr/bin/env bash
# The GPU numbers of docs/BENCHMARKS.md, in one run: every TPOT from `vtcore bench`, each beside its
# peer (HF transformers, same shapes, same prompts) and roofline (copy bandwidth measured in the run).
#   bash scripts/bench_gpu.sh OUTDIR      (after installing vtcore and plugins/qwen3_dense)
set -euo pipefail
out=${1:?usage: bench_gpu.sh OUTDIR}
shapes=$(mktemp -d)
python3 scripts/model_shapes.py "$shapes" >/dev/null
common=(--load-format dummy --dtype bfloat16 --input-len 1024 --output-len 128 --no-progress)
b() { local name=$1; shift; echo "== $name: vtcore bench $*"; vtcore bench "$@" --json "$out/$name.json" 2>&1 \
      | grep -v -i -e warn -e "^ *$" -e External; }
b qwen3-0.6b-async --model "$shapes/qwen3-0.6b" "${common[@]}" --concurrency 1,2,4,8,16,32 --peer hf
b qwen3-0.6b-sync --model "$shapes/qwen3-0.6b" "${common[@]}" --concurrency 1,2,4,8,16,32 --no-async-scheduling
b qwen3-0.6b-eager --model "$shapes/qwen3-0.6b" "${common[@]}" --concurrency 1 --enforce-eager
b qwen3-4b-async --model "$shapes/qwen3-4b" "${common[@]}" --concurrency 1 --peer hf
b qwen3-4b-sync --model "$shapes/qwen3-4b" "${common[@]}" --concurrency 1 --no-async-scheduling
b qwen3-0.6b-offline --model "$shapes/qwen3-0.6b" --load-format dummy --dtype bfloat16 --offline --no-progress
