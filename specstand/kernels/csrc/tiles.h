// Shared by the linear kernel families (linear.cpp: bf16 weights, linear_q8_0.cpp: int8 blocks): how rows
// and columns are tiled and how activations are prepared. None of it changes a row's arithmetic.
#pragma once

#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <ctime>
#include <type_traits>
#include <vector>

#include "linear.h"

namespace specstand {

// The calling thread's CPU time, for the peak-rate loops (single-threaded register loops): on a host whose
// neighbours take turns on the core, wall time would count their turns too.
struct Stopwatch {
  double start = now();
  static double now() {
    timespec t;
    clock_gettime(CLOCK_THREAD_CPUTIME_ID, &t);
    return double(t.tv_sec) + 1e-9 * double(t.tv_nsec);
  }
  double seconds() const { return now() - start; }
};

// Tiles 0-6 zeroed: the operands and accumulators of the peak-rate loops (configured by the caller).
__attribute__((target("amx-tile"))) inline void zero_tiles() {
  _tile_zero(0);
  _tile_zero(1);
  _tile_zero(2);
  _tile_zero(3);
  _tile_zero(4);
  _tile_zero(5);
  _tile_zero(6);
}

// The AMX tile configuration ldtilecfg reads (palette 1: up to 8 tiles of up to 16 rows x 64 bytes).
struct alignas(64) AmxTileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// Every tile 16 rows x 64 bytes: bf16 operands (16 x 32) and fp32 accumulators (16 x 16), for the bf16 linear
// (accumulators 0-3, activations 4-5, weights 6-7) and the AMX attention. Tile state is per thread.
__attribute__((target("amx-tile,amx-bf16,avx512f"))) inline void configure_bf16_tiles() {
  TORCH_CHECK(amx_permitted(), "Linux did not grant this process the AMX tile registers");
  AmxTileConfig config;
  for (int t = 0; t < 8; ++t) {
    config.rows[t] = 16;
    config.colsb[t] = 64;
  }
  __asm__ volatile("" : : "r"(&config) : "memory");  // gcc 12 drops the stores above: ldtilecfg reads them
  _tile_loadconfig(&config);
}

// Tile shapes: rows go in tiles of Max (avx512: 6 rows x 4 strips = 24 accumulators of 32 registers; avx2 q8_0:
// 4 rows x 1 strip x 2 halves = 8 of 16; avx2 bf16 cuts its own), the remainder in one smaller tile. Few rows take
// several strips at once, enough independent accumulators to hide the instruction latency.
template <int R, typename Tile>
inline void tail_rows(int64_t r, int64_t left, Tile& tile) {
  if constexpr (R > 0) {
    if (left == R) {
      tile(r, std::integral_constant<int, R>{});
    } else {
      tail_rows<R - 1>(r, left, tile);
    }
  }
}

template <int Max, typename Tile>
inline void run_rows(int64_t rows, Tile tile) {
  int64_t r = 0;
  for (; r + Max <= rows; r += Max) tile(r, std::integral_constant<int, Max>{});
  tail_rows<Max - 1>(r, rows - r, tile);
}

// Activations rounded to bf16 (RNE) into rows of k_pad, zero-padded: elementwise, so row-independent.
// vcvtneps2bf16 where the CPU has it (it flushes denormals, which the bf16 dot products ignore anyway).
__attribute__((target("avx512f,avx512bw,avx512bf16"))) inline void round_row_avx512bf16(const float* x, uint16_t* y,
                                                                                       int64_t k) {
  int64_t i = 0;
  for (; i + 16 <= k; i += 16)
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(y + i), (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(x + i)));
  for (; i < k; ++i) y[i] = float_to_bf16(x[i]);
}

inline void round_rows_to_bf16(const float* x, int64_t m, int64_t k, int64_t x_stride, uint16_t* xb, int64_t k_pad) {
  static const bool vector = cpu_has(Isa::avx512bf16);
  at::parallel_for(0, m, 8, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      if (vector) {
        round_row_avx512bf16(x + r * x_stride, xb + r * k_pad, k);
      } else {
        for (int64_t kk = 0; kk < k; ++kk) xb[r * k_pad + kk] = float_to_bf16(x[r * x_stride + kk]);
      }
    }
  });
}

// The same rounding into AMX tile order, [row / 16][k / 32][row % 16][32 k]: each 16-row x 32-k activation tile is
// one contiguous KiB. Every row's k_pad (a multiple of 32) is written, k past k as 0; padding rows are the caller's.
__attribute__((target("avx512f,avx512bw,avx512bf16"))) inline void round_row_to_tiles_avx512bf16(const float* x, int64_t k,
                                                                                               uint16_t* xt) {
  for (int64_t k0 = 0; k0 < k; k0 += 32) {
    const __mmask16 m0 = k0 + 16 <= k ? __mmask16(0xffff) : __mmask16((1u << std::max<int64_t>(0, k - k0)) - 1);
    const __mmask16 m1 = k0 + 32 <= k ? __mmask16(0xffff) : __mmask16((1u << std::max<int64_t>(0, k - k0 - 16)) - 1);
    uint16_t* tile_row = xt + (k0 / 32) * 512;
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(tile_row), (__m256i)_mm512_cvtneps_pbh(_mm512_maskz_loadu_ps(m0, x + k0)));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(tile_row + 16),
                        (__m256i)_mm512_cvtneps_pbh(_mm512_maskz_loadu_ps(m1, x + k0 + 16)));
  }
}

inline void round_rows_to_bf16_tiles(const float* x, int64_t m, int64_t k, int64_t x_stride, uint16_t* xt,
                                     int64_t k_pad) {
  static const bool vector = cpu_has(Isa::avx512bf16);
  at::parallel_for(0, m, 8, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      uint16_t* first = xt + (r / 16) * 16 * k_pad + (r % 16) * 32;  // the row's slot in its block's first tile
      if (vector) {
        round_row_to_tiles_avx512bf16(x + r * x_stride, k, first);
      } else {
        for (int64_t kk = 0; kk < k_pad; ++kk)
          first[(kk / 32) * 512 + kk % 32] = kk < k ? float_to_bf16(x[r * x_stride + kk]) : uint16_t(0);
      }
    }
  });
}

// Threads split the output columns only, in groups of up to NB strips of 16: tile(s0, nb) for each group.
// No thread ever shares a reduction over k, which is what keeps rows independent of the row count.
template <int NB, typename Tile>
inline void for_strip_groups(const PackedLinear& w, const Tile& tile) {
  const int64_t strips = w.n_pad / 16;
  at::parallel_for(0, (strips + NB - 1) / NB, 1, [&](int64_t g0, int64_t g1) {
    for (int64_t g = g0; g < g1; ++g) tile(g * NB, std::min<int64_t>(NB, strips - g * NB));
  });
}

// fp32 rows of k_pad, zero-padded: an odd last k meets a zero weight.
inline std::vector<float> padded_rows(const float* x, int64_t m, int64_t k, int64_t x_stride, int64_t k_pad) {
  std::vector<float> xp(m * k_pad, 0.0f);
  for (int64_t r = 0; r < m; ++r) std::memcpy(xp.data() + r * k_pad, x + r * x_stride, k * sizeof(float));
  return xp;
}

}  // namespace specstand
