#!/usr/bin/env bash
# Structured outputs on one GPU (docs/BENCHMARKS.md): the Qwen3-0.6B shape (dummy bf16 weights, the
# embedded default model's tokenizer: its 2048 tokens are the grammar's vocabulary, the other ids are
# never allowed) at concurrency 32, no request constrained, then half of them (interleaved) held to the
# bench's JSON schema, in one call; ROUNDS=N repeats that pair N times (interleaved, for a noisy host) and
# prints each round's ratios and their medians (issue 23's Show: the unconstrained half against the run
# with no constrained requests).
#   [ROUNDS=3] bash scripts/bench_structured.sh OUTDIR   (vtcore, plugins/qwen3_dense and xgrammar installed)
set -uo pipefail
out=${1:?usage: bench_structured.sh OUTDIR}
rounds=${ROUNDS:-1}
shapes=$(mktemp -d)
python3 scripts/model_shapes.py "$shapes" >/dev/null
tok=$(python3 -c "from vtcore.config import DEFAULT_MODEL; print(DEFAULT_MODEL)")
for round in $(seq 1 "$rounds"); do
    suffix=$([ "$rounds" = 1 ] && echo "" || echo "-round$round")
    for share in 0 0.5; do
        echo "== --structured-share $share${suffix:+ ($suffix)}"
        timeout 150 vtcore bench --model "$shapes/qwen3-0.6b" --tokenizer "$tok" --load-format dummy --dtype bfloat16 \
            --no-progress --concurrency 32 --input-len 1024 --output-len 128 --structured-share "$share" \
            --json "$out/structured-share-$share$suffix.json" 2>&1 | grep -v -i -e warn -e "^ *$" -e External
    done
done
python3 - "$out" "$rounds" <<'PY'
import json, statistics, sys
out, rounds = sys.argv[1], int(sys.argv[2])
tpot, throughput = [], []
for r in range(1, rounds + 1):
    suffix = "" if rounds == 1 else f"-round{r}"
    try:
        plain = json.load(open(f"{out}/structured-share-0{suffix}.json"))["runs"][0]
        mixed = json.load(open(f"{out}/structured-share-0.5{suffix}.json"))["runs"][0]["groups"]["unconstrained"]
    except (OSError, KeyError, IndexError) as exc:
        print(f"round {r}: no ratio ({exc!r})")
        continue
    tpot.append(plain["tpot_s"]["median"] / mixed["tpot_s"]["median"])
    share = mixed["requests"] / plain["num_prompts"]  # (the same requests' share of the plain run's output)
    throughput.append(mixed["output_throughput_tok_s"] / (share * plain["output_throughput_tok_s"]))
    print(f"round {r}: unconstrained half / no constraints: TPOT median {tpot[-1]:.3f}x, output {throughput[-1]:.3f}x")
if tpot:
    print(f"median of {len(tpot)} rounds: TPOT {statistics.median(tpot):.3f}x, output {statistics.median(throughput):.3f}x")
PY
