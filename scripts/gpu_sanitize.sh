#!/usr/bin/env bash
# The conformance gate under compute-sanitizer, one process per (tool, family, check), run side by
# side on one GPU (the sanitizer's cost is mostly host-side instrumentation, so jobs in parallel
# finish a family's 15 checks in the time of its slowest). Each job runs its check and the
# prerequisites (example, structure, declares-device-tokens).
# Usage (device machine, vtcore and the families installed):
#   JOBS="memcheck:qwen3_dense:parameters racecheck:llama:async-abc ..." [PARALLEL=12] [JOB_S=480] \
#   [DEADLINE_S=540] bash scripts/gpu_sanitize.sh OUTDIR
# OUTDIR gets summary.txt (one line per job: tool family check rc seconds sanitizer-summary gate-line)
# and logs.tar.gz (every job's full log).
set -uo pipefail
out=${1:?usage: gpu_sanitize.sh OUTDIR}
mkdir -p "$out/logs"
: > "$out/summary.txt"
export OUT_DIR=$out SAN_JOB_S=${JOB_S:-480} SAN_END=$(( $(date +%s) + ${DEADLINE_S:-540} ))
run_one() {
    IFS=: read -r tool family check <<< "$1"
    log="$OUT_DIR/logs/${tool}_${family}_${check}.txt"
    left=$(( SAN_END - $(date +%s) ))
    if (( left < 30 )); then echo "$tool $family $check not-started" >> "$OUT_DIR/summary.txt"; return; fi
    (( left > SAN_JOB_S )) && left=$SAN_JOB_S
    start=$(date +%s)
    timeout "$left" compute-sanitizer --error-exitcode 9 --print-limit 20 --tool "$tool" \
        python3 -m vtcore.cli.main conformance --device cuda --no-quant --family "$family" --check "$check" \
        > "$log" 2>&1
    rc=$?
    san=$(grep -h 'ERROR SUMMARY\|RACECHECK SUMMARY' "$log" | tail -n 1 | tr -s ' ')
    gate=$(grep -h '^PASSED\|^FAILED' "$log" | tail -n 1)
    echo "$tool $family $check rc=$rc $(( $(date +%s) - start ))s | ${san:-no sanitizer summary} | ${gate:-no gate summary}" \
        >> "$OUT_DIR/summary.txt"
}
export -f run_one
printf '%s\n' ${JOBS:?set JOBS} | xargs -P "${PARALLEL:-12}" -I{} bash -c 'run_one "$@"' _ {}
tar -czf "$out/logs.tar.gz" -C "$out" logs && rm -rf "$out/logs"
sort "$out/summary.txt"
