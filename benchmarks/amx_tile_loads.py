"""What a tile load costs an AMX bf16 GEMM: the rate of tdpbf16ps with its operands already in tiles (the
kernels' register-loop peak, which pass_cost.py's roofline uses) beside the same two-by-two tile step the `amx` linear
runs (two activation and two weight tiles loaded for four tdpbf16ps), its operands read from L1, from L2
and streamed from memory; and what each rate makes of a whole Qwen2.5-Coder-0.5B pass by rows.

    python benchmarks/amx_tile_loads.py --out benchmarks/results/kernels/amx_tile_loads.txt

Plain g++ and ctypes (no torch extension): one C file, built into a temporary folder.
"""

from __future__ import annotations

import argparse
import ctypes
import statistics
import subprocess
import tempfile
from pathlib import Path

import torch
from printed import Printed

from specstand import kernels

SOURCE = r"""
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>
#include <chrono>
#include <cstdint>
#include <cstdlib>

struct alignas(64) Config { uint8_t palette = 1, start_row = 0, reserved[14] = {}; uint16_t colsb[16] = {};
                            uint8_t rows[16] = {}; };

// Seconds per tdpbf16ps over `steps` two-by-two steps. Each step reads the next 4 KiB of `data` (2 activation
// tiles, 2 weight tiles; wrapping at `bytes`, a multiple of 4 KiB). -1 where Linux refuses the tile registers.
extern "C" __attribute__((target("amx-tile,amx-bf16"))) double seconds_per_tile_product(long bytes, long steps) {
  if (syscall(SYS_arch_prctl, 0x1023, 18) != 0) return -1.0;  // ARCH_REQ_XCOMP_PERM, XTILEDATA
  Config config;
  for (int t = 0; t < 8; ++t) { config.rows[t] = 16; config.colsb[t] = 64; }
  __asm__ volatile("" : : "r"(&config) : "memory");
  _tile_loadconfig(&config);
  auto* data = static_cast<uint16_t*>(std::aligned_alloc(4096, bytes));
  for (long i = 0; i < bytes / 2; ++i) data[i] = 0x3c00;  // small bf16 values: no overflow over many steps
  _tile_zero(0); _tile_zero(1); _tile_zero(2); _tile_zero(3);  // tile numbers are immediates: no loop
  const long tiles = bytes / 1024;
  long at = 0;
  const auto start = std::chrono::steady_clock::now();
  for (long s = 0; s < steps; ++s) {
    const uint16_t* step = data + at * 512;
    _tile_loadd(6, step, 64);
    _tile_loadd(7, step + 512, 64);
    _tile_loadd(4, step + 1024, 64);
    _tile_loadd(5, step + 1536, 64);
    at = at + 4 < tiles ? at + 4 : 0;
    _tile_dpbf16ps(0, 4, 6);
    _tile_dpbf16ps(2, 4, 7);
    _tile_dpbf16ps(1, 5, 6);
    _tile_dpbf16ps(3, 5, 7);
  }
  alignas(64) float out[256];
  _tile_stored(0, out, 64);
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  volatile float sink = out[0];
  (void)sink;
  std::free(data);
  _tile_release();
  return seconds / (4.0 * steps);
}
"""

MACS_PER_TILE_PRODUCT = 16 * 16 * 32
# The last case reads 4 KiB of new operands every four tile products (none reused, unlike any GEMM): it shows
# one core's read bandwidth, not a compute rate, so it gets no pass estimates.
PEAK = "operands in tiles (register-loop peak)"
CASES = (("loaded from L1 (16 KiB)", 16 << 10), ("loaded from L2 (1 MiB)", 1 << 20),
         ("every operand new from memory (512 MiB)", 512 << 20))
# Qwen2.5-Coder-0.5B's linears per layer (q, k, v, o, gate + up, down; [out, in]) x 24 layers, and its head
QWEN_MACS_PER_ROW = 24 * (896 * 896 + 2 * 128 * 896 + 896 * 896 + 2 * 4864 * 896 + 896 * 4864) + 151936 * 896
QWEN_WEIGHT_BYTES = 2 * QWEN_MACS_PER_ROW  # bf16: one weight read per multiply-accumulate of a row


def build(folder: Path) -> ctypes.CDLL:
    source, library = folder / "tiles.cpp", folder / "tiles.so"
    source.write_text(SOURCE)
    subprocess.run(["g++", "-O3", "-shared", "-fPIC", "-o", str(library), str(source)], check=True)
    function = ctypes.CDLL(str(library)).seconds_per_tile_product
    function.argtypes, function.restype = (ctypes.c_long, ctypes.c_long), ctypes.c_double
    return function


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--cores", type=int, default=2, help="cores the whole-pass estimates divide the work by")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    say = Printed()
    say(f"# AMX tile products with and without their tile loads, one core, medians of {args.repeats}")
    say(f"cpu: {kernels.cpu_model()}; flags: {' '.join(kernels.cpu_flags())}")
    if "amx_bf16" not in kernels.cpu_flags():
        say("this CPU has no AMX: nothing to measure")
        return say.write(args.out)
    torch.set_num_threads(args.cores)
    bandwidth = kernels.read_bandwidth_gbs() * 1e9
    say(f"read bandwidth {bandwidth / 1e9:.1f} GB/s on {args.cores} threads (a Qwen2.5-Coder-0.5B pass reads "
        f"{QWEN_WEIGHT_BYTES / 1e6:.0f} MB of weights: {QWEN_WEIGHT_BYTES / bandwidth * 1e3:.1f} ms)")
    # the peak: the kernels' own register-loop measure, the one pass_cost.py's roofline takes
    rates = {PEAK: statistics.median(kernels.peak_macs_per_second("amx") for _ in range(args.repeats))}
    with tempfile.TemporaryDirectory() as folder:
        measure = build(Path(folder))
        for name, span in CASES:
            steps = 4_000_000 if span <= 1 << 20 else 2_000_000
            seconds = statistics.median(measure(span, steps) for _ in range(args.repeats))
            if seconds < 0:
                say("Linux did not grant this process the AMX tile registers: nothing to measure")
                return say.write(args.out)
            rates[name] = MACS_PER_TILE_PRODUCT / seconds
    say()
    say("operands | ns per tdpbf16ps | GMAC/s per core | % of peak | Qwen ms of tile work at 8 / 16 / 32 / 64 rows "
        f"on {args.cores} cores")
    peak = rates[PEAK]
    for name, rate in rates.items():
        # rows are padded to 16-row blocks: 8 rows cost a 16-row block
        work = [max(rows, 16) * QWEN_MACS_PER_ROW / (rate * args.cores) * 1e3 for rows in (8, 16, 32, 64)]
        estimates = "–" if name == CASES[-1][0] else " / ".join(f"{ms:.1f}" for ms in work)
        say(f"{name} | {MACS_PER_TILE_PRODUCT / rate * 1e9:.2f} | {rate / 1e9:.0f} | {100 * rate / peak:.0f}% | "
            f"{estimates}")
    say.write(args.out)


if __name__ == "__main__":
    main()
