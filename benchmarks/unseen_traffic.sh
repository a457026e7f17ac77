#!/usr/bin/env bash
# Every shipped method with default flags against plain decoding, on function-calling requests the shipped
# drafters never trained on (NESTFUL calls past the 50th: the Qwen drafters trained on ComplexFuncBench calls
# alone), in one process (benchmarks/engine_paired.py: methods alternate, order reversed every round).
#   bash benchmarks/unseen_traffic.sh                                # best kernel path of this CPU
#   SPECSTAND_KERNEL_PATH=avx2 bash benchmarks/unseen_traffic.sh     # a forced path
# MODEL, CALLS, ROUNDS, USERS and OUT override the defaults.
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
PY="$ROOT/.venv/bin/python"
MODEL="${MODEL:-qwen2.5-coder-0.5b}"
WORKLOAD="$ROOT/out/unseen/nestful_skip50.jsonl"
mkdir -p "$(dirname "$WORKLOAD")"
"$ROOT/.venv/bin/specstand" workload import nestful --out "$WORKLOAD" --skip 50 --limit 4 --max-prompt-chars 3000 \
  --max-tokens 128
"$PY" "$ROOT/benchmarks/engine_paired.py" --workload "$WORKLOAD" --model "$MODEL" --users "${USERS:-1}" \
  --methods none,ngram,suffix,schema,eagle3,mtp,dflash,dspark,dflash2 --calls "${CALLS:-4}" \
  --rounds "${ROUNDS:-5}" ${OUT:+--out "$OUT"}
