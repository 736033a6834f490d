#!/usr/bin/env bash
# The served path on one GPU (docs/BENCHMARKS.md): `vtcore bench --serve` on the Qwen3-0.6B shape (dummy bf16
# weights): `vtcore serve` in a child process, the closed loop over OpenAI streaming HTTP against it, the
# server stopped, then the same grid in-process, and where the served TTFT goes; once with the engine on a
# thread of the server's process (--no-engine-core-process), once in a process of its own (the default).
#   bash scripts/bench_served.sh OUTDIR [CONCURRENCY]   (vtcore and plugins/qwen3_dense installed)
set -uo pipefail
out=${1:?usage: bench_served.sh OUTDIR [CONCURRENCY]}
conc=${2:-1,128}
shapes=$(mktemp -d)
python3 scripts/model_shapes.py "$shapes" >/dev/null
for mode in thread core-process; do
    flag=(--engine-core-process); [ "$mode" = thread ] && flag=(--no-engine-core-process)
    echo "== vtcore bench --serve ${flag[*]} --concurrency $conc --input-len 1024 --output-len 128"
    timeout 280 vtcore bench --serve "${flag[@]}" --model "$shapes/qwen3-0.6b" --load-format dummy --dtype bfloat16 \
        --max-num-seqs 128 --concurrency "$conc" --input-len 1024 --output-len 128 --no-progress \
        --json "$out/served-$mode.json" 2>&1 | grep -v -i -e warn -e "^ *$" -e External
done
