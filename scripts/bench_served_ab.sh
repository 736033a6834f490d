#!/usr/bin/env bash
# The served c=1 TTFT of a base vtcore against the working tree's, interleaved, on one GPU (docs/BENCHMARKS.md):
# `vtcore serve` on the Qwen3-0.6B shape (dummy bf16 weights) from BASE (a folder holding a copy of a commit's
# vtcore/, put first on PYTHONPATH: `git archive COMMIT vtcore | tar -x -C BASE`) and from this tree in turn,
# each measured by this tree's client (`vtcore bench --base-url`, 32 requests, 1024 in / 64 out).
#   bash scripts/bench_served_ab.sh BASE OUTDIR [ROUNDS]   (vtcore and plugins/qwen3_dense installed)
set -uo pipefail
base=$(cd "${1:?usage: bench_served_ab.sh BASE OUTDIR [ROUNDS]}" && pwd)
out=${2:?usage: bench_served_ab.sh BASE OUTDIR [ROUNDS]}
rounds=${3:-2}
here=$(cd "$(dirname "$0")/.." && pwd)
shapes=$(mktemp -d)
python3 "$here/scripts/model_shapes.py" "$shapes" >/dev/null
mkdir -p "$out"
cd "$(mktemp -d)"  # (the current directory must not shadow either vtcore)
port=8811
for ((i = 1; i <= rounds; i++)); do
    for tree in "$base" "$here"; do
        name=$([ "$tree" = "$base" ] && echo base || echo tree)
        PYTHONPATH=$tree${PYTHONPATH:+:$PYTHONPATH} timeout 120 python3 -m vtcore.cli.main serve "$shapes/qwen3-0.6b" \
            --load-format dummy --dtype bfloat16 --max-num-seqs 128 --port $port > "$out/serve-$name-$i.log" 2>&1 &
        pid=$!
        for _ in $(seq 100); do curl -s "localhost:$port/health" >/dev/null && break; sleep 1; done
        timeout 60 vtcore bench --base-url "http://127.0.0.1:$port/v1" --concurrency 1 --num-prompts 32 \
            --input-len 1024 --output-len 64 --no-progress 2>&1 | grep -E "^ +1 " | sed "s/^/$name /" \
            | tee -a "$out/served-ab.txt"
        kill $pid; wait $pid 2>/dev/null; port=$((port + 1))
    done
done
