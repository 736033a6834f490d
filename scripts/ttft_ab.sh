#!/usr/bin/env bash
# The in-process c=1 TTFT of a base vtcore against the working tree's, interleaved, on one GPU (docs/BENCHMARKS.md):
# issue 26's 1,024-token prompt and issue 21's prefix hit (2,048 cached + 128 new, caching off then on in one call),
# each from BASE (a folder holding a copy of a commit's vtcore/, put first on PYTHONPATH: `git archive COMMIT vtcore
# | tar -x -C BASE`) and from this tree in turn, dummy bf16 weights of SHAPE (default qwen3-4b; MODEL=PATH instead
# takes a checkpoint folder, e.g. for a dry run on the CPU with DEVICE=cpu and small LEN, PREFIX and NEW).
#   bash scripts/ttft_ab.sh BASE OUTDIR [ROUNDS]   (vtcore and plugins/qwen3_dense installed)
set -uo pipefail
base=$(cd "${1:?usage: ttft_ab.sh BASE OUTDIR [ROUNDS]}" && pwd)
out=${2:?usage: ttft_ab.sh BASE OUTDIR [ROUNDS]}
rounds=${3:-2}
here=$(cd "$(dirname "$0")/.." && pwd)
mkdir -p "$out"
out=$(cd "$out" && pwd)
model=${MODEL:-}
if [ -z "$model" ]; then
    shapes=$(mktemp -d)
    python3 "$here/scripts/model_shapes.py" "$shapes" >/dev/null
    model="$shapes/${SHAPE:-qwen3-4b}"
fi
common=(--model "$model" --load-format dummy --dtype bfloat16 --device "${DEVICE:-cuda}" --concurrency 1
        --output-len 4 --num-prompts 8 --no-progress)
cd "$(mktemp -d)"  # (the current directory must not shadow either vtcore)
for ((i = 1; i <= rounds; i++)); do
    for tree in "$base" "$here"; do
        name=$([ "$tree" = "$base" ] && echo base || echo tree)
        PYTHONPATH=$tree${PYTHONPATH:+:$PYTHONPATH} python3 -m vtcore.cli.main bench "${common[@]}" \
            --input-len "${LEN:-1024}" --json "$out/prompt-$name-$i.json" > "$out/prompt-$name-$i.txt" 2>&1
        PYTHONPATH=$tree${PYTHONPATH:+:$PYTHONPATH} python3 -m vtcore.cli.main bench "${common[@]}" \
            --prefix-len "${PREFIX:-2048}" --input-len "${NEW:-128}" --compare-prefix-caching \
            --json "$out/hit-$name-$i.json" > "$out/hit-$name-$i.txt" 2>&1
        python3 - "$out" "$name" "$i" <<'PY'
import json, sys
out, name, i = sys.argv[1:]
prompt = json.load(open(f"{out}/prompt-{name}-{i}.json"))["runs"][0]["ttft_s"]["median"]
hit = json.load(open(f"{out}/hit-{name}-{i}.json"))
off, on = hit["prefix_caching_off"]["runs"][0]["ttft_s"]["median"], hit["runs"][0]["ttft_s"]["median"]
print(f"{name} round {i}: TTFT median {1e3 * prompt:.2f} ms (prompt); hit off -> on {1e3 * off:.2f} -> "
      f"{1e3 * on:.2f} ms ({on / off:.3f}x)")
PY
    done
done | tee "$out/ttft-ab.txt"
