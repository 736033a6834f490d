#!/usr/bin/env bash
# Structured outputs on one GPU (docs/BENCHMARKS.md): the Qwen3-0.6B shape (dummy bf16 weights, the
# embedded default model's tokenizer: its 2048 tokens are the grammar's vocabulary, the other ids are
# never allowed) at concurrency 32, no request constrained, then half of them (interleaved) held to the
# bench's JSON schema, in one call; ROUNDS=N repeats that pair N times (interleaved, for a noisy host) and
# prints each round's ratios and their medians (issue 23's Show: the unconstrained half against the run
# with no constrained requests); SERVE=1 runs each through `vtcore bench --serve` (the served engine, over
# HTTP, then in-process) and prints the ratios of both.
#   [ROUNDS=3] [SERVE=1] bash scripts/bench_structured.sh OUTDIR   (vtcore, plugins/qwen3_dense, xgrammar)
set -uo pipefail
out=${1:?usage: bench_structured.sh OUTDIR}
rounds=${ROUNDS:-1}
serve=$([ "${SERVE:-0}" = 1 ] && echo --serve || echo "")
shapes=$(mktemp -d)
python3 scripts/model_shapes.py "$shapes" >/dev/null
tok=$(python3 -c "from vtcore.config import DEFAULT_MODEL; print(DEFAULT_MODEL)")
for round in $(seq 1 "$rounds"); do
    suffix=$([ "$rounds" = 1 ] && echo "" || echo "-round$round")
    for share in 0 0.5; do
        echo "== --structured-share $share${suffix:+ ($suffix)}"
        timeout 300 vtcore bench $serve --model "$shapes/qwen3-0.6b" --tokenizer "$tok" --load-format dummy --dtype bfloat16 \
            --no-progress --concurrency 32 --input-len 1024 --output-len 128 --structured-share "$share" \
            --json "$out/structured-share-$share$suffix.json" 2>&1 | grep -v -i -e warn -e "^ *$" -e External
    done
done
python3 - "$out" "$rounds" <<'PY'
import json, statistics, sys
out, rounds = sys.argv[1], int(sys.argv[2])
ratios = {}  # (side, measure) -> per-round ratios
for r in range(1, rounds + 1):
    suffix = "" if rounds == 1 else f"-round{r}"
    try:
        docs = [json.load(open(f"{out}/structured-share-{share}{suffix}.json")) for share in ("0", "0.5")]
    except OSError as exc:
        print(f"round {r}: no ratio ({exc!r})")
        continue
    for side in ("served", "inprocess") if "served" in docs[0] else ("inprocess",):
        plain, mixed = (d.get(side, d)["runs"][0] for d in docs)
        mixed = mixed["groups"]["unconstrained"]
        share = mixed["requests"] / plain["num_prompts"]  # (the same requests' share of the plain run's output)
        tpot = plain["tpot_s"]["median"] / mixed["tpot_s"]["median"]
        output = mixed["output_throughput_tok_s"] / (share * plain["output_throughput_tok_s"])
        ratios.setdefault((side, "TPOT median"), []).append(tpot)
        ratios.setdefault((side, "output"), []).append(output)
        print(f"round {r}, {side}: unconstrained half / no constraints: TPOT median {tpot:.3f}x, output {output:.3f}x")
for (side, measure), values in ratios.items():
    print(f"{side}, median of {len(values)} rounds: {measure} {statistics.median(values):.3f}x")
PY
