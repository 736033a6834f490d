#!/usr/bin/env bash
# Qwen3.5's MTP head on one GPU (issue 22's Show; docs/BENCHMARKS.md): `vtcore bench --speculative-config
# '{"method": "mtp", ...}'` on dummy weights of the Qwen3.5-35B-A3B shape at batch 1: the plain decode step,
# replay-bound verify steps for k = 1..3 with the head running (its drafts unused), the MTP head's own time
# a step (CUDA events), and the head's own drafts (dummy weights: next to nothing accepted), async and sync.
# The bf16 shape needs about 70 GB of weights: on a GPU of less than 100 GiB the NVFP4A16 shape runs instead.
#   bash scripts/bench_mtp.sh OUTDIR   (vtcore, plugins/qwen3_5 and plugins/quant_nvfp4 installed)
set -uo pipefail
out=${1:?usage: bench_mtp.sh OUTDIR}
shapes=$(mktemp -d)
python3 scripts/model_shapes.py "$shapes" >/dev/null
shape=qwen3.5-35b-a3b
python3 -c "import sys, torch; sys.exit(torch.cuda.get_device_properties(0).total_memory < 100 * 2**30)" ||
    shape=qwen3.5-35b-a3b-nvfp4
mtp='{"method": "mtp", "num_speculative_tokens": 3}'
echo "== $shape: vtcore bench --speculative-config $mtp"
timeout 500 vtcore bench --model "$shapes/$shape" --load-format dummy --dtype bfloat16 --no-progress \
    --speculative-config "$mtp" --speculative-k 1,2,3 --concurrency 1 --input-len 1024 --output-len 64 \
    --json "$out/bench-mtp-$shape.json" 2>&1 | grep -v -i -e warn -e "^ *$" -e External
echo "(rc ${PIPESTATUS[0]})"
echo "== the same, the head's own drafts on the sync engine (the run above: async, depth 2)"
timeout 300 vtcore bench --model "$shapes/$shape" --load-format dummy --dtype bfloat16 --no-progress \
    --speculative-config "$mtp" --speculative-k 3 --concurrency 1 --input-len 1024 --output-len 64 \
    --no-async-scheduling --json "$out/bench-mtp-sync-$shape.json" 2>&1 | grep -v -i -e warn -e "^ *$" -e External
echo "(rc ${PIPESTATUS[0]})"
