#!/usr/bin/env bash
# Servers started together against the same servers started one at a time, in one bench. A server profiles
# its passes at start; started beside others that load the CPU, its profile is taken on a busy machine, and
# adaptive verification must correct it from the passes it runs (docs/adaptive_verification.md). Each server's
# profiled and corrected pass costs are read from /metrics after start and after the bench.
#   bash benchmarks/start_together.sh OUT_DIR
#   START_ONLY=1 MODEL=qwen2.5-coder-0.5b bash benchmarks/start_together.sh OUT_DIR   # the profiles alone, no bench
# MODEL, METHODS (comma-separated), DTYPE, USERS, REPEATS and WORKLOAD override the defaults.
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
SPEC="$ROOT/.venv/bin/specstand"
OUT="${1:?usage: start_together.sh OUT_DIR}"
MODEL="${MODEL:-smollm2-135m}"
METHODS="${METHODS:-none,ngram,suffix}"
DTYPE="${DTYPE:-q8_0}"  # pinned: dtype auto also measures at start, and would mix two effects
WORKLOAD="${WORKLOAD:-$ROOT/out/demo/workload.jsonl}"
mkdir -p "$OUT"
IFS=, read -r -a methods <<< "$METHODS"
pids=()
trap 'kill "${pids[@]}" 2>/dev/null || true' EXIT

serve() {  # serve GROUP METHOD PORT: one server in the background, its log in OUT
  "$SPEC" serve --model "$MODEL" --method "$2" --dtype "$DTYPE" --max-seq-len 4096 --max-batch 4 --port "$3" \
    > "$OUT/serve-$1-$2.log" 2>&1 &
  pids+=($!)
}
source "$ROOT/benchmarks/wait_ready.sh"
record_costs() {  # record_costs WHEN: each server's profiled and corrected pass seconds on /metrics
  local port=8300 group m
  for group in together alone; do
    for m in "${methods[@]}"; do
      port=$((port + 1))
      echo "# $group-$m $1"
      curl -sf "http://127.0.0.1:$port/metrics" | grep -E '^specstand:pass_seconds_(profiled|estimated)' || true
    done
  done >> "$OUT/pass_costs.txt"
}

port=8300
for m in "${methods[@]}"; do serve together "$m" $((port += 1)); done  # all at once
for ((i = 0; i < ${#methods[@]}; i++)); do wait_ready $((8301 + i)) "${pids[i]}" "$OUT/serve-together-${methods[i]}.log"; done
for m in "${methods[@]}"; do
  serve alone "$m" $((port += 1)); wait_ready $port "${pids[-1]}" "$OUT/serve-alone-$m.log"  # then the next starts
done
: > "$OUT/pass_costs.txt"
record_costs "after start"
[[ -n "${START_ONLY:-}" ]] && exit 0
endpoints=()
port=8300
for group in together alone; do
  for m in "${methods[@]}"; do endpoints+=(--endpoint "$group-$m=http://127.0.0.1:$((port += 1))"); done
done
"$SPEC" bench --workload "$WORKLOAD" --model "$MODEL" "${endpoints[@]}" --baseline alone-none \
  --users "${USERS:-1,4}" --repeats "${REPEATS:-3}" --warm system --out "$OUT"
record_costs "after the bench"
