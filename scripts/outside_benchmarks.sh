#!/usr/bin/env bash
# Two outside benchmark clients against a running `vtcore serve` (README, "Serving"): guidellm (synthetic prompts
# with a shared prefix over /v1/completions, Poisson arrivals; then chat and responses at concurrency 4) and
# NVIDIA's aiperf (chat, completions and responses, streamed; --reset-kv-cache and --server-profiler, which need the
# server's development endpoints and its profiler: VTCORE_SERVER_DEV_MODE=1 vtcore serve --profiler-config JSON).
# Each must finish every request with no error; their reports go to OUTDIR.
#   bash scripts/outside_benchmarks.sh URL MODEL_DIR OUTDIR   (guidellm and aiperf on PATH; offline is fine)
# MODEL_DIR is the served checkpoint: both clients load its tokenizer, guidellm by the served model's name
# (a link of that name to MODEL_DIR, in a scratch folder it runs from), aiperf through a hub cache it is given.
set -euo pipefail
url=${1:?usage: outside_benchmarks.sh URL MODEL_DIR OUTDIR}
model_dir=$(cd "${2:?usage: outside_benchmarks.sh URL MODEL_DIR OUTDIR}" && pwd)
out=$(mkdir -p "${3:?usage: outside_benchmarks.sh URL MODEL_DIR OUTDIR}" && cd "$3" && pwd)
name=$(python3 - "$url" <<'PY'
import json, sys, urllib.request
print(json.load(urllib.request.urlopen(sys.argv[1] + "/v1/models"))["data"][0]["id"])
PY
)
scratch=$(mktemp -d)
ln -s "$model_dir" "$scratch/$name"
snapshot="$scratch/hub/models--local--served/snapshots/0"
mkdir -p "$snapshot" "$scratch/hub/models--local--served/refs"
printf 0 > "$scratch/hub/models--local--served/refs/main"
cp "$model_dir"/tokenizer* "$model_dir/config.json" "$snapshot/"
export HF_HUB_OFFLINE=1 HF_HUB_CACHE="$scratch/hub"
cd "$scratch"
echo "== guidellm: /v1/completions, Poisson 6/s, 128 + 32 shared prefix tokens in, 48 out"
guidellm run --backend "kind=openai_http,target=$url,request_format=/v1/completions" --profile kind=poisson,rate=6 \
    --data kind=synthetic_text,prompt_tokens=128,output_tokens=48,prefix_tokens=32 \
    --constraint kind=max_requests,count=24 \
    --disable-progress --output "kind=json,path=$out/guidellm-completions.json" | tail -n 12
echo "== guidellm: /v1/chat/completions, concurrency 4, 64 in, 32 out"
guidellm run --backend "kind=openai_http,target=$url" --profile kind=concurrent,streams=4 \
    --data kind=synthetic_text,prompt_tokens=64,output_tokens=32 --constraint kind=max_requests,count=16 \
    --disable-progress --output "kind=json,path=$out/guidellm-chat.json" | tail -n 12
echo "== guidellm: /v1/responses, concurrency 4, 64 in, 32 out"
guidellm run --backend "kind=openai_http,target=$url,request_format=/v1/responses" --profile kind=concurrent,streams=4 \
    --data kind=synthetic_text,prompt_tokens=64,output_tokens=32 --constraint kind=max_requests,count=12 \
    --disable-progress --output "kind=json,path=$out/guidellm-responses.json" | tail -n 12
for endpoint in chat completions responses; do
    echo "== aiperf: $endpoint, streamed, concurrency 4, 64 in, 32 out, the prefix cache reset first, profiled"
    aiperf profile -m "$name" --tokenizer local/served --url "$url" --endpoint-type "$endpoint" --streaming \
        --concurrency 4 --request-count 16 --synthetic-input-tokens-mean 64 --output-tokens-mean 32 \
        --extra-inputs ignore_eos:true --reset-kv-cache --server-profiler --artifact-dir "$out/aiperf-$endpoint" \
        --ui-type none \
        | grep -E "Request Error Rate|Completed Requests|Time to First Token|Request Latency"
done
python3 - "$out" <<'PY'
import json, sys
out = sys.argv[1]
for name in ("guidellm-completions", "guidellm-chat", "guidellm-responses"):
    reqs = json.load(open(f"{out}/{name}.json"))["benchmarks"][0]["requests"]
    print(f"{name}: {len(reqs['successful'])} successful, {len(reqs['errored'])} errored, "
          f"{len(reqs['incomplete'])} incomplete")
    assert not reqs["errored"] and not reqs["incomplete"], name
for endpoint in ("chat", "completions", "responses"):
    rows = [json.loads(line) for line in open(f"{out}/aiperf-{endpoint}/profile_export.jsonl")]
    usage = [r["metrics"]["usage_completion_tokens"]["value"] for r in rows]
    print(f"aiperf {endpoint}: {len(rows)} records, server-counted output tokens {sorted(set(usage))}")
    assert len(rows) == 16 and set(usage) == {32}, endpoint
PY
