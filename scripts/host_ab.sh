#!/usr/bin/env bash
# The engine loop's host time a step (vtcore bench's `engine loop` line) of a base commit against the working
# tree, on this machine's CPU, interleaved: the base runs from a git worktree put first on PYTHONPATH (run from
# a directory outside both trees, so the current directory does not shadow it). docs/BENCHMARKS.md.
#   bash scripts/host_ab.sh BASE_COMMIT [ROUNDS] [BENCH FLAGS...]   (vtcore installed, editable, from this tree)
set -uo pipefail
base=${1:?usage: host_ab.sh BASE_COMMIT [ROUNDS] [BENCH FLAGS...]}
rounds=${2:-3}
shift $(( $# < 2 ? $# : 2 ))
flags=("$@")
[ ${#flags[@]} -gt 0 ] || flags=(--concurrency 128 --num-prompts 256 --input-len 64 --output-len 64 --max-num-seqs 128)
here=$(cd "$(dirname "$0")/.." && pwd)
wt=$(mktemp -d)
git -C "$here" worktree add -q --detach "$wt" "$base" || exit 1
trap 'git -C "$here" worktree remove --force "$wt"' EXIT
cd "$(mktemp -d)"
for ((i = 1; i <= rounds; i++)); do
    for tree in "$wt" "$here"; do
        printf '%s: ' "$([ "$tree" = "$wt" ] && echo "base $base" || echo "tree")"
        PYTHONPATH=$tree python -m vtcore.cli.main bench "${flags[@]}" --no-progress 2>&1 | grep "engine loop" \
            | sed 's/.*steps: //'
    done
done
