#!/usr/bin/env bash
# The served path on one GPU (docs/BENCHMARKS.md): `vtcore serve` on the Qwen3-0.6B shape (dummy bf16
# weights), `vtcore bench --base-url` against it over OpenAI streaming HTTP, then the same grid in-process
# (the server stopped first: one engine on the GPU at a time).
#   bash scripts/bench_served.sh OUTDIR [CONCURRENCY]   (vtcore and plugins/qwen3_dense installed)
set -uo pipefail
out=${1:?usage: bench_served.sh OUTDIR [CONCURRENCY]}
conc=${2:-1,128}
shapes=$(mktemp -d)
python3 scripts/model_shapes.py "$shapes" >/dev/null
model="$shapes/qwen3-0.6b"
engine=(--load-format dummy --dtype bfloat16 --max-num-seqs 128)
grid=(--concurrency "$conc" --input-len 1024 --output-len 128)
vtcore serve --model "$model" "${engine[@]}" --port 8011 > "$out/serve.log" 2>&1 &
pid=$!
python3 - <<'PY'
import time, urllib.request
for _ in range(150):
    try:
        urllib.request.urlopen("http://127.0.0.1:8011/health", timeout=2)
        break
    except OSError:
        time.sleep(1)
PY
echo "== served: vtcore bench --base-url http://127.0.0.1:8011/v1 ${grid[*]}"
timeout 120 vtcore bench --base-url http://127.0.0.1:8011/v1 "${grid[@]}" --json "$out/served.json" 2>&1 | tail -n 4
kill -TERM $pid; wait $pid
echo "== in-process: vtcore bench ${grid[*]}"
timeout 120 vtcore bench --model "$model" "${engine[@]}" "${grid[@]}" --no-progress --json "$out/inprocess.json" 2>&1 \
    | grep -v -i -e warn -e External | tail -n 6
