#!/usr/bin/env bash
# The conformance gate on the GPU: every family with --device cuda (the decode CUDA graphs in float32
# and bfloat16 included), then each family again under compute-sanitizer memcheck, and the async checks
# under racecheck. Results and logs under $OUT (default /tmp/vtcore-gpu-conformance).
# Usage (device machine): [STAGES="gate memcheck racecheck"] bash scripts/gpu_conformance.sh [FAMILY ...]
set -uo pipefail
OUT=${OUT:-/tmp/vtcore-gpu-conformance}
mkdir -p "$OUT"
python3 -m pip install --no-deps --no-build-isolation -q -e . -e plugins/qwen3_dense -e plugins/qwen3_5 \
    -e examples/vtcore-llama -e examples/vtcore-qwen2 > "$OUT/install.txt" 2>&1 || { cat "$OUT/install.txt"; exit 1; }
families=("$@")
[ ${#families[@]} -gt 0 ] || families=(llama qwen2 qwen3_5 qwen3_5_moe qwen3_dense)
args=(--device cuda --no-quant)
for f in "${families[@]}"; do args+=(--family "$f"); done
stages=${STAGES:-gate memcheck racecheck}
start=$(date +%s)
if [[ $stages == *gate* ]]; then
    python3 -m vtcore.cli.main conformance "${args[@]}" --json "$OUT/conformance_cuda.json" > "$OUT/conformance_cuda.txt" 2>&1
    echo "gate rc=$? in $(( $(date +%s) - start )) s"; grep -v '^\[transformers\]' "$OUT/conformance_cuda.txt" | tail -n 12
fi
san=(compute-sanitizer --error-exitcode 9 --print-limit 20)
[[ $stages == *memcheck* ]] && for f in "${families[@]}"; do
    start=$(date +%s)
    timeout "${MEMCHECK_S:-240}" "${san[@]}" --tool memcheck python3 -m vtcore.cli.main conformance --device cuda --no-quant --family "$f" \
        > "$OUT/memcheck_$f.txt" 2>&1
    echo "memcheck $f rc=$? in $(( $(date +%s) - start )) s: $(grep -h 'ERROR SUMMARY' "$OUT/memcheck_$f.txt" | tail -n 1)"
    grep -h '^PASSED\|^FAILED' "$OUT/memcheck_$f.txt"
done
[[ $stages == *racecheck* ]] && for f in "${families[@]}"; do
    start=$(date +%s)
    timeout "${RACECHECK_S:-240}" "${san[@]}" --tool racecheck python3 -m vtcore.cli.main conformance --device cuda --no-quant --family "$f" \
        --check async-abc --check async-batch1-x5 --check async-concurrency --check async-max-tokens \
        > "$OUT/racecheck_$f.txt" 2>&1
    echo "racecheck $f rc=$? in $(( $(date +%s) - start )) s: $(grep -h 'RACECHECK SUMMARY\|ERROR SUMMARY' "$OUT/racecheck_$f.txt" | tail -n 1)"
    grep -h '^PASSED\|^FAILED' "$OUT/racecheck_$f.txt"
done
