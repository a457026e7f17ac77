#!/usr/bin/env bash
# llama-cpp-python's OpenAI server as a peer of the stand: the preset's own GGUF, 2 threads, its prompt cache on.
#   benchmarks/peers/llama_cpp_server.sh install            # source build into .venv-llama (native flags)
#   benchmarks/peers/llama_cpp_server.sh serve MODEL PORT   # MODEL: a specstand preset name
# On an AMX Xeon llama-cpp-python 0.3.36's native build (AMX_INT8 on) segfaults on the Qwen preset's GGUF at the
# first completion, so AMX is built off there (the system info line it prints says AMX_INT8 = 0); --no-cache-dir keeps pip from reusing a wheel built with other
# flags. The build's flags are written beside the venv (build-flags.txt) and printed at every start.
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/../.." && pwd)"
VENV="${LLAMA_VENV:-$ROOT/.venv-llama}"
GGUF_DIR="${GGUF_DIR:-$ROOT/out/peers}"

case "${1:-}" in
  install)
    [ -x "$VENV/bin/python" ] || python3 -m venv "$VENV"
    flags="-DGGML_NATIVE=ON"
    if grep -q amx_int8 /proc/cpuinfo; then
      # GGML_NATIVE compiles with -march=native, which turns AMX on whatever GGML_AMX_* say (seen: the
      # "AMX model buffer" and the segfault with -DGGML_AMX_INT8=OFF): name this CPU's other ISAs instead
      flags="-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_AVX512=ON"
      flags="$flags -DGGML_AVX512_VBMI=ON -DGGML_AVX512_VNNI=ON -DGGML_AVX512_BF16=ON -DGGML_AVX_VNNI=ON"
      flags="$flags -DGGML_AMX_INT8=OFF -DGGML_AMX_TILE=OFF -DGGML_AMX_BF16=OFF"
    fi
    CMAKE_ARGS="$flags" "$VENV/bin/pip" install -q --no-cache-dir 'llama-cpp-python[server]==0.3.36'
    echo "llama-cpp-python 0.3.36, CMAKE_ARGS=$flags" > "$VENV/build-flags.txt"
    ;;
  serve)
    model="$2"; port="$3"
    mkdir -p "$GGUF_DIR"
    gguf="$GGUF_DIR/$model.gguf"
    if [ ! -f "$gguf" ]; then
      "$ROOT/.venv/bin/python" - "$model" "$gguf" <<'EOF'
import sys, tempfile
from pathlib import Path
from specstand.models.presets import PRESETS, download_gguf
with tempfile.TemporaryDirectory() as work:
    part = Path(sys.argv[2] + ".part")
    download_gguf(PRESETS[sys.argv[1]], Path(work), part, log=lambda _: None)
    part.rename(sys.argv[2])
EOF
    fi
    echo "llama-cpp-python server: $(cat "$VENV/build-flags.txt" 2>/dev/null || echo 'build flags not recorded')" >&2
    "$VENV/bin/python" -c "import llama_cpp; print(llama_cpp.llama_print_system_info().decode())" >&2
    exec "$VENV/bin/python" -m llama_cpp.server --model "$gguf" --model_alias "$model" --port "$port" \
      --n_threads 2 --n_threads_batch 2 --n_ctx 4096 --cache true --cache_type ram
    ;;
  *) echo "usage: $0 install | serve MODEL PORT" >&2; exit 2 ;;
esac
