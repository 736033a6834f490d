#!/usr/bin/env bash
# The conformance gate on the GPU: every family with --device cuda (the decode CUDA graphs in float32
# and bfloat16 included), then every check of each family again under compute-sanitizer memcheck, and
# the async checks under racecheck, one process per check (PARALLEL, JOB_S, DEADLINE_S as in
# scripts/gpu_sanitize.sh). Results and logs under $OUT (default /tmp/vtcore-gpu-conformance).
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
# the sanitizers: one process per (tool, family, check), side by side (scripts/gpu_sanitize.sh)
checks=$(python3 -c "from vtcore.conformance import CHECKS; from vtcore.conformance.checks import PREREQUISITES as P; print(' '.join(c for c in CHECKS if c not in P))")
jobs=""
for f in "${families[@]}"; do
    [[ $stages == *memcheck* ]] && for c in $checks; do jobs="$jobs memcheck:$f:$c"; done
    [[ $stages == *racecheck* ]] && for c in $checks; do [[ $c == async-* ]] && jobs="$jobs racecheck:$f:$c"; done
done
[ -n "$jobs" ] && JOBS="$jobs" bash "$(dirname "$0")/gpu_sanitize.sh" "$OUT/sanitizer"
