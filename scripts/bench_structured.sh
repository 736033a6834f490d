#!/usr/bin/env bash
# Structured outputs on one GPU (docs/BENCHMARKS.md): the Qwen3-0.6B shape (dummy bf16 weights, the
# embedded default model's tokenizer: its 2048 tokens are the grammar's vocabulary, the other ids are
# never allowed) at concurrency 32, no request constrained, then half of them (interleaved) held to the
# bench's JSON schema, in one call.
#   bash scripts/bench_structured.sh OUTDIR   (vtcore, plugins/qwen3_dense and xgrammar installed)
set -uo pipefail
out=${1:?usage: bench_structured.sh OUTDIR}
shapes=$(mktemp -d)
python3 scripts/model_shapes.py "$shapes" >/dev/null
tok=$(python3 -c "from vtcore.config import DEFAULT_MODEL; print(DEFAULT_MODEL)")
for share in 0 0.5; do
    echo "== --structured-share $share"
    timeout 150 vtcore bench --model "$shapes/qwen3-0.6b" --tokenizer "$tok" --load-format dummy --dtype bfloat16 \
        --no-progress --concurrency 32 --input-len 1024 --output-len 128 --structured-share "$share" \
        --json "$out/structured-share-$share.json" 2>&1 | grep -v -i -e warn -e "^ *$" -e External
done
