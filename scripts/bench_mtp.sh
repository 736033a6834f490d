#!/usr/bin/env bash
# Qwen3.5's MTP head on one GPU (issue 22's Show; docs/BENCHMARKS.md): `vtcore bench --speculative-config
# '{"method": "mtp", ...}'` on dummy weights of the Qwen3.5-35B-A3B shape at batch 1: the plain decode step,
# replay-bound verify steps for k = 1..3 with the head running (its drafts unused), the MTP head's own time
# a step (CUDA events), and the head's own drafts (dummy weights: next to nothing accepted), async and sync.
#   bash scripts/bench_mtp.sh OUTDIR   (vtcore and plugins/qwen3_5 installed)
set -uo pipefail
out=${1:?usage: bench_mtp.sh OUTDIR}
shapes=$(mktemp -d)
python3 scripts/model_shapes.py "$shapes" >/dev/null
mtp='{"method": "mtp", "num_speculative_tokens": 3}'
echo "== qwen3.5-35b-a3b: vtcore bench --speculative-config $mtp"
timeout 500 vtcore bench --model "$shapes/qwen3.5-35b-a3b" --load-format dummy --dtype bfloat16 --no-progress \
    --speculative-config "$mtp" --speculative-k 1,2,3 --concurrency 1 --input-len 1024 --output-len 64 \
    --json "$out/bench-mtp-qwen3.5-35b-a3b.json" 2>&1 | grep -v -i -e warn -e "^ *$" -e External
echo "(rc ${PIPESTATUS[0]})"
echo "== the same, the head's own drafts on the sync engine (the run above: async, depth 2)"
timeout 300 vtcore bench --model "$shapes/qwen3.5-35b-a3b" --load-format dummy --dtype bfloat16 --no-progress \
    --speculative-config "$mtp" --speculative-k 3 --concurrency 1 --input-len 1024 --output-len 64 \
    --no-async-scheduling --json "$out/bench-mtp-sync-qwen3.5-35b-a3b.json" 2>&1 | grep -v -i -e warn -e "^ *$" -e External
echo "(rc ${PIPESTATUS[0]})"
