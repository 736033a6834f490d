#!/usr/bin/env bash
# Speculative decoding on one GPU (docs/BENCHMARKS.md): the gate's speculative check on CUDA (verify rows
# in CUDA graphs against the oracle), then `vtcore bench --speculative-config` on dummy weights of the
# Qwen3-4B shape (replay bound for k = 1..8 beside the plain step, batch 1, 16, 64), and n-gram's real
# acceptance on the embedded default model, the host's search (sync) beside the device's (async).
#   bash scripts/bench_speculative.sh OUTDIR   (vtcore, plugins/qwen3_dense and plugins/qwen3_5 installed)
set -uo pipefail
out=${1:?usage: bench_speculative.sh OUTDIR}
shapes=$(mktemp -d)
python3 scripts/model_shapes.py "$shapes" >/dev/null
quiet() { grep -v -i -e warn -e "^ *$" -e External; }
echo "== vtcore conformance --device cuda --no-quant --check speculative"
timeout 200 vtcore conformance --device cuda --no-quant --check speculative 2>&1 | quiet | tail -n 25
ngram='{"method": "ngram", "num_speculative_tokens": 4}'
echo "== qwen3-4b: vtcore bench --speculative-config $ngram"
timeout 330 vtcore bench --model "$shapes/qwen3-4b" --load-format dummy --dtype bfloat16 --no-progress \
    --speculative-config "$ngram" --concurrency 1,16,64 --input-len 1024 --output-len 128 \
    --json "$out/bench-speculative-qwen3-4b.json" 2>&1 | quiet
echo "(rc ${PIPESTATUS[0]})"
echo "== embedded default model: n-gram acceptance"
timeout 60 vtcore bench --speculative-config "$ngram" --speculative-k 4 --concurrency 1,16 --input-len 256 \
    --output-len 128 --no-progress --json "$out/bench-speculative-default.json" 2>&1 | quiet
echo "(rc ${PIPESTATUS[0]})"
echo "== embedded default model: the n-gram on the device, async (beside the host's above)"
timeout 60 vtcore bench --speculative-config "$ngram" --speculative-k 4 --concurrency 1,16 --input-len 256 \
    --output-len 128 --no-progress --async-scheduling --json "$out/bench-speculative-default-async.json" 2>&1 | quiet
echo "(rc ${PIPESTATUS[0]})"
