#!/usr/bin/env bash
# Where the served path's front end spends its time (docs/BENCHMARKS.md): `vtcore serve` on the Qwen3-0.6B shape
# (dummy bf16 weights, the engine core in its own process) under the stack sampler of scripts/profile_stacks.py,
# driven by `vtcore bench --base-url` at one concurrency; the sampler's table of the server process's threads
# is written to OUTDIR/served-stacks.txt when the server stops, the engine core process's to served-stacks.txt.PID.
#   bash scripts/profile_served.sh OUTDIR [CONCURRENCY]   (vtcore, plugins/qwen3_dense, fastapi and uvicorn installed)
set -uo pipefail
out=${1:?usage: profile_served.sh OUTDIR [CONCURRENCY]}
conc=${2:-128}
port=8765
shapes=$(mktemp -d)
python3 scripts/model_shapes.py "$shapes" >/dev/null
model=${MODEL:-$shapes/qwen3-0.6b}  # (MODEL: another checkpoint, e.g. a smoke run on CPU)
python3 scripts/profile_stacks.py "$out/served-stacks.txt" serve --model "$model" --load-format dummy \
    --dtype bfloat16 --max-num-seqs 128 --port "$port" > "$out/served-server.log" 2>&1 &
server=$!
for _ in $(seq 240); do
    python3 -c "import urllib.request; urllib.request.urlopen('http://127.0.0.1:$port/health')" 2>/dev/null && break
    kill -0 "$server" 2>/dev/null || { echo "the server exited:"; tail -n 20 "$out/served-server.log"; exit 1; }
    sleep 0.5
done
echo "== vtcore bench --base-url http://127.0.0.1:$port/v1 --concurrency $conc --input-len 1024 --output-len 128"
timeout 200 vtcore bench --base-url "http://127.0.0.1:$port/v1" --model "$model" --concurrency "$conc" \
    --input-len 1024 --output-len 128 --no-progress --json "$out/served-profiled.json" 2>&1 \
    | grep -v -i -e warn -e "^ *$" -e External
kill -INT "$server"; wait "$server"
for f in "$out"/served-stacks.txt*; do echo "== $f"; grep -v -e threading.py -e importlib -e _bootstrap "$f" | head -n 45; done
