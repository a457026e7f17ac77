#!/usr/bin/env bash
# Servers of an older tree against this tree's, in one bench: each method served by both trees (plain decoding
# by this tree only, the baseline), started one at a time so that each profiles its passes on a quiet machine,
# then every run interleaved, so that the host's drift hits both sides alike.
#   git worktree add /tmp/base COMMIT
#   bash benchmarks/ab_servers.sh /tmp/base OUT_DIR
# MODEL, METHODS (space-separated, "none" first), DTYPE, USERS, REPEATS and WORKLOAD override the defaults.
# The bench itself is this tree's. The older tree's kernels are built from its own sources.
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
BASE="$(cd "${1:?usage: ab_servers.sh BASE_TREE OUT_DIR}" && pwd)"
OUT="${2:?usage: ab_servers.sh BASE_TREE OUT_DIR}"
PYTHON="$ROOT/.venv/bin/python"
source "$ROOT/benchmarks/wait_ready.sh"
MODEL="${MODEL:-smollm2-135m}"
DTYPE="${DTYPE:-q8_0}"  # pinned: dtype auto measures at start, and would mix two effects
WORKLOAD="$(realpath "${WORKLOAD:-$ROOT/out/demo/workload.jsonl}")"
mkdir -p "$OUT"
pids=()
trap 'kill "${pids[@]}" 2>/dev/null || true' EXIT
port=8400
endpoints=()
for side in old new; do
  tree="$ROOT"; [[ $side == old ]] && tree="$BASE"
  for method in ${METHODS:-none ngram suffix dflash}; do
    [[ $side == old && $method == none ]] && continue
    port=$((port + 1))
    # from outside either tree, so that PYTHONPATH alone picks the tree's package
    (cd / && PYTHONPATH="$tree" exec "$PYTHON" -m specstand.cli serve --model "$MODEL" --method "$method" \
      --dtype "$DTYPE" --max-seq-len 4096 --max-batch 4 --port $port) > "$OUT/serve-$side-$method.log" 2>&1 &
    pids+=($!)
    wait_ready $port "${pids[-1]}" "$OUT/serve-$side-$method.log"
    endpoints+=(--endpoint "$side-$method=http://127.0.0.1:$port")
  done
done
"$ROOT/.venv/bin/specstand" bench --workload "$WORKLOAD" --model "$MODEL" "${endpoints[@]}" --baseline new-none \
  --users "${USERS:-1,4}" --repeats "${REPEATS:-3}" --warm system --out "$OUT"
