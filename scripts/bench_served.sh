#!/usr/bin/env bash
# The served path on one GPU (docs/BENCHMARKS.md): `vtcore bench --serve` on the Qwen3-0.6B shape (dummy bf16
# weights): `vtcore serve` in a child process, the closed loop over OpenAI streaming HTTP against it, the
# server stopped, then the same grid in-process, and where the served TTFT goes.
#   bash scripts/bench_served.sh OUTDIR [CONCURRENCY]   (vtcore and plugins/qwen3_dense installed)
set -uo pipefail
out=${1:?usage: bench_served.sh OUTDIR [CONCURRENCY]}
conc=${2:-1,128}
shapes=$(mktemp -d)
python3 scripts/model_shapes.py "$shapes" >/dev/null
echo "== vtcore bench --serve --concurrency $conc --input-len 1024 --output-len 128"
timeout 300 vtcore bench --serve --model "$shapes/qwen3-0.6b" --load-format dummy --dtype bfloat16 --max-num-seqs 128 \
    --concurrency "$conc" --input-len 1024 --output-len 128 --no-progress --json "$out/served.json" 2>&1 \
    | grep -v -i -e warn -e "^ *$"
