#!/usr/bin/env bash
# The served path on one GPU (docs/BENCHMARKS.md): `vtcore bench --serve` on the Qwen3-0.6B shape (dummy bf16
# weights): `vtcore serve` in a child process, the closed loop over OpenAI streaming HTTP against it, the
# server stopped, then the same grid in-process, and where the served TTFT goes; once with the engine on a
# thread of the server's process (--no-engine-core-process), once in a process of its own (the default).
# CLIENTS=12,16 instead runs the engine-core-process mode once per bench client-process count, in that order
# (an A/B of the client's share of the machine's cores; CLIENTS=16,16 shows what a first run pays).
#   [CLIENTS=N,M] bash scripts/bench_served.sh OUTDIR [CONCURRENCY]   (vtcore and plugins/qwen3_dense installed)
set -uo pipefail
out=${1:?usage: bench_served.sh OUTDIR [CONCURRENCY]}
conc=${2:-1,128}
shapes=$(mktemp -d)
python3 scripts/model_shapes.py "$shapes" >/dev/null
run() {  # NAME FLAGS...
    local name=$1; shift
    echo "== vtcore bench --serve $* --concurrency $conc --input-len 1024 --output-len 128"
    timeout 280 vtcore bench --serve "$@" --model "$shapes/qwen3-0.6b" --load-format dummy --dtype bfloat16 \
        --max-num-seqs 128 --concurrency "$conc" --input-len 1024 --output-len 128 --no-progress \
        --json "$out/served-$name.json" 2>&1 | grep -v -i -e warn -e "^ *$" -e External
}
if [ -n "${CLIENTS:-}" ]; then
    i=0
    for n in ${CLIENTS//,/ }; do
        i=$((i + 1))
        run "core-process-clients$n-$i" --engine-core-process --client-processes "$n"
    done
else
    run thread --no-engine-core-process
    run core-process --engine-core-process
fi
