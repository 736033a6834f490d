#!/usr/bin/env bash
# The conformance gate on the GPU: every family with --device cuda (the decode CUDA graphs in float32
# and bfloat16 included), one process per family side by side (the gate is mostly host work, Triton
# compiles and graph captures: all five families in one process ran past 530 s), each cut at GATE_S
# seconds (default 480; its progress lines say which checks had ended); then every check of each family
# again under compute-sanitizer memcheck, and the async checks under racecheck, one process per check
# (PARALLEL, JOB_S, DEADLINE_S as in scripts/gpu_sanitize.sh). Results and logs under $OUT (default
# /tmp/vtcore-gpu-conformance): gate_FAMILY.txt (the progress lines, then the report) and, for a family that
# finished, gate_FAMILY.json. DEVICE=cpu runs the gate stage on the CPU. Exit status: 1 if a family failed or did
# not finish.
# Usage (device machine): [STAGES="gate memcheck racecheck"] bash scripts/gpu_conformance.sh [FAMILY ...]
set -uo pipefail
[[ ${GATE_S:-480} =~ ^[0-9]+$ ]] || { echo "GATE_S=$GATE_S: expected whole seconds, e.g. GATE_S=480" >&2; exit 2; }
OUT=${OUT:-/tmp/vtcore-gpu-conformance}
mkdir -p "$OUT"
python3 -m pip install --no-deps --no-build-isolation -q -e . -e plugins/qwen3_dense -e plugins/qwen3_5 \
    -e examples/vtcore-llama -e examples/vtcore-qwen2 > "$OUT/install.txt" 2>&1 || { cat "$OUT/install.txt"; exit 1; }
families=("$@")
[ ${#families[@]} -gt 0 ] || families=(llama qwen2 qwen3_5 qwen3_5_moe qwen3_dense)
stages=${STAGES:-gate memcheck racecheck}
start=$(date +%s)
status=0
if [[ $stages == *gate* ]]; then
    declare -A pids
    for f in "${families[@]}"; do
        timeout -k 30 "${GATE_S:-480}" python3 -m vtcore.cli.main conformance --device "${DEVICE:-cuda}" \
            --no-quant --family "$f" --json "$OUT/gate_$f.json" > "$OUT/gate_$f.txt" 2>&1 &
        pids[$f]=$!
    done
    for f in "${families[@]}"; do  # the verdict, or how the run ended and how many checks had; what failed
        wait "${pids[$f]}"
        rc=$?
        (( rc == 0 )) || status=1
        verdict=$(grep -h '^PASSED\|^FAILED' "$OUT/gate_$f.txt" | tail -n 1)
        ended=$(grep -Ec '  [A-Z]+  [0-9.]+ s$' "$OUT/gate_$f.txt")
        cut=$( (( rc == 124 || rc == 137 )) && echo " (cut at GATE_S)")
        echo "$f: rc=$rc$cut, ${verdict:-no verdict}, $ended checks ended"
        grep -Eh '^FAIL |  FAIL  [0-9.]+ s$' "$OUT/gate_$f.txt"
    done
    echo "gate in $(( $(date +%s) - start )) s"
fi
# the sanitizers: one process per (tool, family, check), side by side (scripts/gpu_sanitize.sh)
checks=$(python3 -c "from vtcore.conformance import CHECKS; from vtcore.conformance.checks import PREREQUISITES as P; print(' '.join(c for c in CHECKS if c not in P))")
jobs=""
for f in "${families[@]}"; do
    [[ $stages == *memcheck* ]] && for c in $checks; do jobs="$jobs memcheck:$f:$c"; done
    [[ $stages == *racecheck* ]] && for c in $checks; do [[ $c == async-* ]] && jobs="$jobs racecheck:$f:$c"; done
done
if [ -n "$jobs" ]; then JOBS="$jobs" bash "$(dirname "$0")/gpu_sanitize.sh" "$OUT/sanitizer" || status=1; fi
exit $status
