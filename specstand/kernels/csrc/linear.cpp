// The linear kernel family: one packed layout, three instruction paths side by side.
//
// Batch invariance by construction: an output element owns one accumulator, which is updated once per
// k pair, in k order, by the same instruction, whatever tile of rows and columns it shares; there is no
// split over k, and threads split the output columns only. So row i of an m-row call is bit-identical to
// a 1-row call for every m. The tiles change how often a weight is reused, never the arithmetic.
//   avx512bf16: vdpbf16ps, activations rounded to bf16 (RNE), fp32 accumulation (DAZ/FTZ in hardware).
//   avx2:       bf16 weights widened to fp32 in registers, fp32 activations, one FMA per k.
//   amx:        tdpbf16ps on 16-row tiles (fewer rows are zero-padded to 16, so a row always meets the same
//               instruction sequence), activations rounded to bf16 and laid out tile by tile, weights padded to
//               32 k; two row blocks share each weight tile loaded (further pairs of blocks re-read the strips
//               from L2; prompts go in chunks of rows whose activations stay in L2). The MLP's gate/up can run
//               fused with its activation (linear_silu_mul), writing bf16 tiles the down projection reads as they are.
//   scalar:     the same sums in plain C++ (one fmaf per k), for CPUs with neither.
#include "linear.h"
#include "tiles.h"

#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <immintrin.h>

#include <vector>

namespace specstand {

PackedLinear pack_linear(const at::Tensor& weight, Isa isa) {
  TORCH_CHECK(weight.dim() == 2 && weight.scalar_type() == at::kBFloat16, "pack_linear takes a 2-D bf16 weight");
  at::Tensor w = weight.contiguous();
  PackedLinear p;
  p.n = w.size(0);
  p.k = w.size(1);
  p.n_pad = (p.n + 15) / 16 * 16;
  p.k_pad = isa == Isa::amx ? (p.k + 31) / 32 * 32 : (p.k + 1) / 2 * 2;  // amx: whole 32-k tiles
  p.isa = isa;
  p.data = at::zeros({p.n_pad * p.k_pad}, at::kBFloat16);
  auto* dst = reinterpret_cast<uint16_t*>(p.data.data_ptr());
  p.base = dst;
  const auto* src = reinterpret_cast<const uint16_t*>(w.data_ptr());
  at::parallel_for(0, p.n, 64, [&](int64_t begin, int64_t end) {
    for (int64_t col = begin; col < end; ++col) {
      uint16_t* strip = dst + (col / 16) * p.k_pad * 16;
      for (int64_t kk = 0; kk < p.k; ++kk) strip[(kk / 2) * 32 + (col % 16) * 2 + (kk % 2)] = src[col * p.k + kk];
    }
  });
  return p;
}

// ---- avx512bf16: R rows x NB strips of 16 columns, one zmm accumulator each -----------------------
// Rows past the first R sweep the same strips again, from cache, while the memory stream would idle: so with
// `ahead` > 0 this sweep (number `sweep` of `sweeps` over these strips) also streams its share of the next
// `ahead` strips' lines into L2, and the memory stream runs through every sweep.
template <int R, int NB>
__attribute__((target("avx512f,avx512bw,avx512bf16"))) static void tile_avx512bf16(
    const PackedLinear& w, int64_t s0, const uint16_t* xb, int64_t xs, float* y, int64_t ys, int64_t col0,
    int64_t ahead, int64_t sweep, int64_t sweeps) {
  __m512 acc[R][NB];
  for (int r = 0; r < R; ++r)
    for (int b = 0; b < NB; ++b) acc[r][b] = _mm512_setzero_ps();
  const uint16_t* strips[NB];
  for (int b = 0; b < NB; ++b) strips[b] = w.strip(s0 + b);
  const int64_t pairs = w.k_pad / 2;
  const uint16_t* next = ahead > 0 ? w.strip(s0 + NB) : nullptr;
  int64_t fetched = -1;  // a strip's k pair is one cache line
  for (int64_t p = 0; p < pairs; ++p) {
    if (ahead > 0) {
      const int64_t line = (sweep * pairs + p) / sweeps;
      if (line != fetched)
        for (int64_t b = 0; b < ahead; ++b)
          _mm_prefetch(reinterpret_cast<const char*>(next + b * w.k_pad * 16 + line * 32), _MM_HINT_T1);
      fetched = line;
    }
    __m512i wv[NB];
    for (int b = 0; b < NB; ++b) wv[b] = _mm512_load_si512(reinterpret_cast<const void*>(strips[b] + p * 32));
    for (int r = 0; r < R; ++r) {
      int32_t pair;
      std::memcpy(&pair, xb + r * xs + 2 * p, 4);
      const __m512i xv = _mm512_set1_epi32(pair);
      for (int b = 0; b < NB; ++b) acc[r][b] = _mm512_dpbf16_ps(acc[r][b], (__m512bh)xv, (__m512bh)wv[b]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int b = 0; b < NB; ++b) {
      const int64_t col = col0 + b * 16;
      const int64_t valid = std::min<int64_t>(16, w.n - col);
      if (valid == 16) {
        _mm512_storeu_ps(y + r * ys + col, acc[r][b]);
      } else if (valid > 0) {
        _mm512_mask_storeu_ps(y + r * ys + col, (__mmask16)((1u << valid) - 1), acc[r][b]);
      }
    }
}

// ---- avx2: R rows x NB strips; a strip's 16 columns are two ymm accumulators -------------------------
// Two register plans, the same arithmetic (per element: an FMA for k even, then for k odd, per pair, in k order):
//   rows first (R >= 2): per k the NB strips' weights are widened once (a shift, or a mask for odd k), then each
//     row's activation is broadcast once and meets all 2 NB of them: 2 R NB accumulators + 2 NB weights + 1.
//   columns first (1 row): the row's activation stays in a register and each weight vector is widened as it is
//     used, so 4 strips (8 accumulators) fit.
// Tile shapes as measured on Zen 4 (weights in L1, thread CPU time, 58 GMAC/s FMA peak a core): 5 x 1 strips
// 58 (the peak), 4 x 1 54, 2 x 2 54, 3 x 1 44, 1 x 4 (columns first) 49; 6 x 1 (15 of 16 ymm) spills: 39.
// W[col, 2p + odd] of the 8 columns at `at` (a strip's k pair p, half h: strip + p * 32 + h * 16), as fp32.
__attribute__((target("avx2"), always_inline)) static inline __m256 widened_bf16(const uint16_t* at, int odd) {
  const __m256i v = _mm256_load_si256(reinterpret_cast<const __m256i*>(at));
  return _mm256_castsi256_ps(odd ? _mm256_and_si256(v, _mm256_set1_epi32(int32_t(0xffff0000u)))
                                 : _mm256_slli_epi32(v, 16));
}

template <int R, int NB>
__attribute__((target("avx2,fma"))) static void tile_avx2(
    const PackedLinear& w, int64_t s0, const float* x, int64_t xs, float* y, int64_t ys) {
  constexpr bool rows_first = R >= 2;
  static_assert(rows_first ? 2 * R * NB + 2 * NB + 1 <= 15 : NB <= 4, "accumulators and operands in 16 ymm");
  __m256 acc[R][NB][2];
  for (int r = 0; r < R; ++r)
    for (int b = 0; b < NB; ++b) acc[r][b][0] = acc[r][b][1] = _mm256_setzero_ps();
  const uint16_t* strips[NB];
  for (int b = 0; b < NB; ++b) strips[b] = w.strip(s0 + b);
  const int64_t pairs = w.k_pad / 2;
  for (int64_t p = 0; p < pairs; ++p) {
    for (int odd = 0; odd < 2; ++odd) {
      if constexpr (rows_first) {
        __m256 wv[NB][2];
        for (int b = 0; b < NB; ++b)
          for (int h = 0; h < 2; ++h) wv[b][h] = widened_bf16(strips[b] + p * 32 + h * 16, odd);
        for (int r = 0; r < R; ++r) {
          const __m256 xv = _mm256_broadcast_ss(x + r * xs + 2 * p + odd);
          for (int b = 0; b < NB; ++b)
            for (int h = 0; h < 2; ++h) acc[r][b][h] = _mm256_fmadd_ps(xv, wv[b][h], acc[r][b][h]);
        }
      } else {
        const __m256 xv = _mm256_broadcast_ss(x + 2 * p + odd);
        for (int b = 0; b < NB; ++b)
          for (int h = 0; h < 2; ++h)
            acc[0][b][h] = _mm256_fmadd_ps(xv, widened_bf16(strips[b] + p * 32 + h * 16, odd), acc[0][b][h]);
      }
    }
  }
  alignas(32) float tmp[16];
  for (int r = 0; r < R; ++r)
    for (int b = 0; b < NB; ++b) {
      const int64_t col = (s0 + b) * 16;
      const int64_t valid = std::min<int64_t>(16, w.n - col);
      if (valid == 16) {
        _mm256_storeu_ps(y + r * ys + col, acc[r][b][0]);
        _mm256_storeu_ps(y + r * ys + col + 8, acc[r][b][1]);
        continue;
      }
      _mm256_store_ps(tmp, acc[r][b][0]);
      _mm256_store_ps(tmp + 8, acc[r][b][1]);
      for (int64_t c = 0; c < valid; ++c) y[r * ys + col + c] = tmp[c];
    }
}

// ---- scalar: the same per-element order (k even, then k odd, per pair) --------------------------------
static void tile_scalar(const PackedLinear& w, int64_t s, const float* x, int64_t xs, int64_t rows, float* y,
                        int64_t ys) {
  const uint16_t* strip = w.strip(s);
  const int64_t pairs = w.k_pad / 2;
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = 0; c < 16 && s * 16 + c < w.n; ++c) {
      float acc = 0.0f;
      for (int64_t p = 0; p < pairs; ++p) {
        acc = std::fmaf(x[r * xs + 2 * p], bf16_to_float(strip[p * 32 + c * 2]), acc);
        acc = std::fmaf(x[r * xs + 2 * p + 1], bf16_to_float(strip[p * 32 + c * 2 + 1]), acc);
      }
      y[r * ys + s * 16 + c] = acc;
    }
}

// When sweeps stream the next strips (several requests' rows): from 12 rows, two sweeps of 6 or more, the later
// sweeps' compute is long enough to hide the memory stream behind (at 8 rows it was no faster); prompts (hundreds
// of rows) keep L2 for their activations; and a group of strips with the next beside it must fit well inside L2
// (1 MiB a core on Zen 4): Qwen's down projection (k 4864, 622 KB a group) ran slower with it.
constexpr int64_t AVX512_STREAM_AHEAD_MIN_ROWS = 12, AVX512_STREAM_AHEAD_MAX_ROWS = 64;
constexpr int64_t AVX512_STREAM_AHEAD_MAX_GROUP_BYTES = 256 << 10;

static void linear_avx512bf16(const PackedLinear& w, const float* x, int64_t m, int64_t x_stride, float* y,
                              int64_t y_stride) {
  std::vector<uint16_t> xb(m * w.k_pad, 0);
  round_rows_to_bf16(x, m, w.k, x_stride, xb.data(), w.k_pad);
  constexpr int NB = 4, MAX_ROWS = 6;
  const int64_t strips = w.n_pad / 16, sweeps = (m + MAX_ROWS - 1) / MAX_ROWS;
  const bool stream_ahead = m >= AVX512_STREAM_AHEAD_MIN_ROWS && m <= AVX512_STREAM_AHEAD_MAX_ROWS &&
                            NB * w.k_pad * 16 * int64_t(sizeof(uint16_t)) <= AVX512_STREAM_AHEAD_MAX_GROUP_BYTES;
  // threads split the groups of output columns only (as for_strip_groups), each streaming toward its own next group
  at::parallel_for(0, (strips + NB - 1) / NB, 1, [&](int64_t g0, int64_t g1) {
    for (int64_t g = g0; g < g1; ++g) {
      const int64_t s0 = g * NB, nb = std::min<int64_t>(NB, strips - s0);
      const int64_t ahead = stream_ahead && g + 1 < g1 ? std::min<int64_t>(NB, strips - s0 - NB) : 0;
      int64_t sweep = 0;
      run_rows<MAX_ROWS>(m, [&](int64_t r, auto rows) {
        constexpr int R = decltype(rows)::value;
        const uint16_t* xr = xb.data() + r * w.k_pad;
        float* yr = y + r * y_stride;
        switch (nb) {
          case 4: tile_avx512bf16<R, 4>(w, s0, xr, w.k_pad, yr, y_stride, s0 * 16, ahead, sweep, sweeps); break;
          case 3: tile_avx512bf16<R, 3>(w, s0, xr, w.k_pad, yr, y_stride, s0 * 16, ahead, sweep, sweeps); break;
          case 2: tile_avx512bf16<R, 2>(w, s0, xr, w.k_pad, yr, y_stride, s0 * 16, ahead, sweep, sweeps); break;
          default: tile_avx512bf16<R, 1>(w, s0, xr, w.k_pad, yr, y_stride, s0 * 16, ahead, sweep, sweeps); break;
        }
        ++sweep;
      });
    }
  });
}

// Strips a tile of R rows takes at once (see tile_avx2's measured shapes).
template <int R>
constexpr int avx2_strips() {
  return R >= 3 ? 1 : R == 2 ? 2 : 4;
}

template <int R>
static void tile_avx2_strips(const PackedLinear& w, int64_t s0, int64_t nb, const float* x, int64_t xs, float* y,
                             int64_t ys) {
  constexpr int NB = avx2_strips<R>();
  int64_t s = s0;
  for (; s + NB <= s0 + nb; s += NB) tile_avx2<R, NB>(w, s, x, xs, y, ys);
  for (; s < s0 + nb; ++s) tile_avx2<R, 1>(w, s, x, xs, y, ys);
}

// Rows in tiles of 5, the last ones re-cut so that no tile of 3 or 1 is left where 4 + 2 or 4 + 4 fit.
static std::vector<int64_t> avx2_row_tiles(int64_t m) {
  std::vector<int64_t> tiles(m / 5, 5);
  const int64_t left = m % 5;
  if (!tiles.empty() && (left == 1 || left == 3)) {
    tiles.pop_back();
    tiles.push_back(4);
    tiles.push_back(left == 1 ? 2 : 4);
  } else if (left > 0) {
    tiles.push_back(left);
  }
  return tiles;
}

// Threads take groups of 4 strips (64 columns); within a group each row tile sweeps all its strips while its
// activations sit in L1 and the group's weights in L2.
static void linear_avx2(const PackedLinear& w, const float* x, int64_t m, int64_t x_stride, float* y,
                        int64_t y_stride) {
  const std::vector<float> xp = padded_rows(x, m, w.k, x_stride, w.k_pad);
  const std::vector<int64_t> tiles = avx2_row_tiles(m);
  for_strip_groups<4>(w, [&](int64_t s0, int64_t nb) {
    int64_t r = 0;
    for (const int64_t rows : tiles) {
      const float* xr = xp.data() + r * w.k_pad;
      float* yr = y + r * y_stride;
      switch (rows) {
        case 5: tile_avx2_strips<5>(w, s0, nb, xr, w.k_pad, yr, y_stride); break;
        case 4: tile_avx2_strips<4>(w, s0, nb, xr, w.k_pad, yr, y_stride); break;
        case 3: tile_avx2_strips<3>(w, s0, nb, xr, w.k_pad, yr, y_stride); break;
        case 2: tile_avx2_strips<2>(w, s0, nb, xr, w.k_pad, yr, y_stride); break;
        default: tile_avx2_strips<1>(w, s0, nb, xr, w.k_pad, yr, y_stride); break;
      }
      r += rows;
    }
  });
}

static void linear_scalar(const PackedLinear& w, const float* x, int64_t m, int64_t x_stride, float* y,
                          int64_t y_stride) {
  const std::vector<float> xp = padded_rows(x, m, w.k, x_stride, w.k_pad);
  for_strip_groups<1>(w, [&](int64_t s, int64_t) { tile_scalar(w, s, xp.data(), w.k_pad, m, y, y_stride); });
}

// ---- amx: 16 rows x 16 columns per accumulator tile, 32 k per tdpbf16ps -----------------------------------

// MB (1 or 2) blocks of 16 rows x NB strips of 16 columns: MB * NB <= 4 accumulator tiles (0-3), each 32-k step
// loads MB activation tiles (4, 5) and NB weight tiles (6, 7; a third and fourth strip reuse them), so a weight
// tile loaded once serves MB blocks and an activation tile NB strips.
constexpr int PREFETCH_STEPS = 6;  // k steps of 32 a weight prefetch runs ahead
template <int MB, int NB>
__attribute__((target("amx-tile,amx-bf16,avx512f"))) static void tile_amx(const PackedLinear& w,
                                                                          const uint16_t* const* strips,
                                                                          const uint16_t* xt, float* const* dest,
                                                                          const int64_t* dest_stride) {
  static_assert(MB <= 2 && MB * NB <= 4, "four accumulator tiles, two activation tiles");
  _tile_zero(0);
  if (MB * NB > 1) _tile_zero(1);
  if (MB * NB > 2) _tile_zero(2);
  if (MB * NB > 3) _tile_zero(3);
  const int64_t block_stride = 16 * w.k_pad;  // a block's tiles, in k order
  for (int64_t p = 0; p < w.k_pad / 2; p += 16) {
    const uint16_t* xp = xt + 32 * p;
    const int64_t ahead = p + 16 * PREFETCH_STEPS;
    if (ahead < w.k_pad / 2)  // weights a few k steps ahead into L2: DRAM latency
      for (int b = 0; b < NB; ++b)
        for (int line = 0; line < 16; ++line)
          _mm_prefetch(reinterpret_cast<const char*>(strips[b] + ahead * 32 + line * 32), _MM_HINT_T1);
    if (p + 16 < w.k_pad / 2)  // the next step's tiles into L1: a tile load waits on every line it misses
      for (int b = 0; b < NB; ++b)
        for (int line = 0; line < 16; ++line)
          _mm_prefetch(reinterpret_cast<const char*>(strips[b] + (p + 16) * 32 + line * 32), _MM_HINT_T0);
    if constexpr (MB == 1) {
      _tile_loadd(4, xp, 64);
      _tile_loadd(6, strips[0] + p * 32, 64);
      _tile_dpbf16ps(0, 4, 6);
      if constexpr (NB > 1) {
        _tile_loadd(7, strips[1] + p * 32, 64);
        _tile_dpbf16ps(1, 4, 7);
      }
      if constexpr (NB > 2) {
        _tile_loadd(6, strips[2] + p * 32, 64);
        _tile_dpbf16ps(2, 4, 6);
      }
      if constexpr (NB > 3) {
        _tile_loadd(7, strips[3] + p * 32, 64);
        _tile_dpbf16ps(3, 4, 7);
      }
    } else {
      _tile_loadd(4, xp, 64);
      _tile_loadd(5, xp + block_stride, 64);
      _tile_loadd(6, strips[0] + p * 32, 64);
      _tile_dpbf16ps(0, 4, 6);
      _tile_dpbf16ps(1, 5, 6);
      if constexpr (NB > 1) {
        _tile_loadd(7, strips[1] + p * 32, 64);
        _tile_dpbf16ps(2, 4, 7);
        _tile_dpbf16ps(3, 5, 7);
      }
    }
  }
  // accumulator of (block i, strip b): tile b for MB == 1, i + 2 * b for MB == 2; each to dest[tile] (bytes a row:
  // dest_stride[tile])
  _tile_stored(0, dest[0], dest_stride[0]);
  if (MB * NB > 1) _tile_stored(1, dest[1], dest_stride[1]);
  if (MB * NB > 2) _tile_stored(2, dest[2], dest_stride[2]);
  if (MB * NB > 3) _tile_stored(3, dest[3], dest_stride[3]);
}

// Copies an accumulator tile (16 x 16 fp32, rows from row0, columns from col) into y.
__attribute__((target("avx512f"))) static void store_amx_tile(const PackedLinear& w, const float* tile, int64_t row0,
                                                              int64_t m, int64_t col, float* y, int64_t y_stride) {
  const int64_t rows = std::min<int64_t>(16, m - row0), valid = std::min<int64_t>(16, w.n - col);
  const __mmask16 columns = (__mmask16)(valid == 16 ? 0xffff : (1u << valid) - 1);
  for (int64_t r = 0; r < rows; ++r)
    _mm512_mask_storeu_ps(y + (row0 + r) * y_stride + col, columns, _mm512_load_ps(tile + r * 16));
}

// A whole accumulator tile (16 rows, 16 columns inside y) is stored straight into y; a ragged one goes through
// `out` and is copied.
template <int MB, int NB>
static void run_amx(const PackedLinear& w, const uint16_t* xb, int64_t block0, int64_t m, int64_t s0, float* out,
                    float* y, int64_t y_stride) {
  float* dest[4];
  int64_t dest_stride[4];
  bool whole[4];
  for (int i = 0; i < MB; ++i)
    for (int b = 0; b < NB; ++b) {
      const int t = MB == 1 ? b : i + 2 * b;
      const int64_t row0 = (block0 + i) * 16, col = (s0 + b) * 16;
      whole[t] = row0 + 16 <= m && col + 16 <= w.n;
      dest[t] = whole[t] ? y + row0 * y_stride + col : out + t * 256;
      dest_stride[t] = whole[t] ? y_stride * int64_t(sizeof(float)) : 64;
    }
  const uint16_t* strips[NB];
  for (int b = 0; b < NB; ++b) strips[b] = w.strip(s0 + b);
  tile_amx<MB, NB>(w, strips, xb + block0 * 16 * w.k_pad, dest, dest_stride);
  for (int i = 0; i < MB; ++i)
    for (int b = 0; b < NB; ++b) {
      const int t = MB == 1 ? b : i + 2 * b;
      if (!whole[t]) store_amx_tile(w, out + t * 256, (block0 + i) * 16, m, (s0 + b) * 16, y, y_stride);
    }
}

// One group of up to four strips (64 columns) for row blocks [first, last): pairs of blocks on pairs of strips (an
// odd strip alone), then an odd last block on all the strips at once. Any shape gives the same arithmetic per element.
static void strip_group_amx(const PackedLinear& w, const uint16_t* xb, int64_t m, int64_t first, int64_t last,
                            int64_t s0, int64_t nb, float* out, float* y, int64_t y_stride) {
  const int64_t pairs_end = first + (last - first) / 2 * 2;
  int64_t b = 0;
  for (; b + 2 <= nb; b += 2)
    for (int64_t block = first; block < pairs_end; block += 2) run_amx<2, 2>(w, xb, block, m, s0 + b, out, y, y_stride);
  if (b < nb)
    for (int64_t block = first; block < pairs_end; block += 2) run_amx<2, 1>(w, xb, block, m, s0 + b, out, y, y_stride);
  if (pairs_end < last) {
    switch (nb) {
      case 4: run_amx<1, 4>(w, xb, pairs_end, m, s0, out, y, y_stride); break;
      case 3: run_amx<1, 3>(w, xb, pairs_end, m, s0, out, y, y_stride); break;
      case 2: run_amx<1, 2>(w, xb, pairs_end, m, s0, out, y, y_stride); break;
      default: run_amx<1, 1>(w, xb, pairs_end, m, s0, out, y, y_stride); break;
    }
  }
}

// Activation bytes a chunk of row blocks may take: each thread runs all its strips on one chunk before the next, so
// a chunk's activation tiles stay in L2 while the strips' weights stream past (prompts of 512 rows x 4864 k hold 5 MB).
constexpr int64_t AMX_ROW_CHUNK_BYTES = 1 << 20;

// Row blocks a chunk takes: whole pairs whose activation tiles fit in AMX_ROW_CHUNK_BYTES.
static int64_t amx_row_chunk(int64_t k_pad) {
  return std::max<int64_t>(2, AMX_ROW_CHUNK_BYTES / (16 * k_pad * 2) / 2 * 2);
}

// Activations in tile order (torch's allocator aligns them to 64 bytes); rows past m pad the last block with 0.
static at::Tensor amx_activation_tiles(const float* x, int64_t m, int64_t k, int64_t x_stride, int64_t k_pad) {
  const int64_t blocks = (m + 15) / 16;
  at::Tensor tiles = at::empty({blocks * 16 * k_pad}, at::kBFloat16);
  uint16_t* xb = reinterpret_cast<uint16_t*>(tiles.data_ptr());
  if (m % 16) std::memset(xb + (blocks - 1) * 16 * k_pad, 0, 16 * k_pad * sizeof(uint16_t));
  round_rows_to_bf16_tiles(x, m, k, x_stride, xb, k_pad);
  return tiles;
}

void linear_from_tiles(const PackedLinear& w, const uint16_t* xb, int64_t m, float* y, int64_t y_stride) {
  TORCH_CHECK(w.isa == Isa::amx && w.format == Format::bf16, "linear_from_tiles runs bf16 weights on amx");
  const int64_t blocks = (m + 15) / 16;
  constexpr int NB = 4;
  const int64_t strips = w.n_pad / 16, groups = (strips + NB - 1) / NB, chunk = amx_row_chunk(w.k_pad);
  at::parallel_for(0, groups, 1, [&](int64_t g0, int64_t g1) {
    configure_bf16_tiles();  // tile state is per thread
    alignas(64) float out[4 * 256];
    for (int64_t first = 0; first < blocks; first += chunk)
      for (int64_t g = g0; g < g1; ++g)
        strip_group_amx(w, xb, m, first, std::min(blocks, first + chunk), g * NB, std::min<int64_t>(NB, strips - g * NB),
                        out, y, y_stride);
  });
}

static void linear_amx(const PackedLinear& w, const float* x, int64_t m, int64_t x_stride, float* y,
                       int64_t y_stride) {
  const at::Tensor tiles = amx_activation_tiles(x, m, w.k, x_stride, w.k_pad);
  linear_from_tiles(w, reinterpret_cast<const uint16_t*>(tiles.data_ptr()), m, y, y_stride);
}

// ---- amx, the MLP's gate/up fused with its activation ---------------------------------------------------------
// Gate strip j and up strip j + I / 16 share a tile step, so one step's four accumulators hold both halves of 16
// intermediate columns for two row blocks; silu(gate) * up is taken there and rounded to bf16 straight into the
// down projection's tile order. The [rows x 2I] fp32 output and the [rows x I] activation never go through memory:
// on prompts they are most of an MLP's traffic. Every value is the one linear, silu_mul and the down projection's
// own rounding make (the same tile products, the same silu_mul, vcvtneps2bf16 as round_rows_to_bf16_tiles).

bool fuses_silu_mul(const PackedLinear& gate_up) {
  return gate_up.isa == Isa::amx && gate_up.format == Format::bf16 && gate_up.n % 64 == 0 &&
         cpu_has(Isa::avx512bf16);
}

// Rows r of one 16-column slice: act[r] = bf16(silu(gate[r]) * up[r]) (16 floats a row, 16 rows).
__attribute__((target("avx512f,avx512bf16"))) static void silu_mul_tile_rows(const float* gate, const float* up,
                                                                           uint16_t* act) {
  for (int r = 0; r < 16; ++r) {
    v16f g, u;
    std::memcpy(&g, gate + r * 16, sizeof(g));
    std::memcpy(&u, up + r * 16, sizeof(u));
    const v16f a = silu_mul(g, u);
    __m512 av;
    std::memcpy(&av, &a, sizeof(a));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(act + r * 32), (__m256i)_mm512_cvtneps_pbh(av));
  }
}

// Intermediate columns [16 j, 16 j + 16) of MB row blocks from block0 (accumulator of (block i, strip b): tile
// b for MB == 1, i + 2 b for MB == 2, as in run_amx).
template <int MB>
static void silu_mul_step_amx(const PackedLinear& w, const uint16_t* xb, int64_t block0, int64_t j, float* out,
                              uint16_t* act) {
  const int64_t I = w.n / 2;
  const uint16_t* strips[2] = {w.strip(j), w.strip(j + I / 16)};
  float* dest[4] = {out, out + 256, out + 512, out + 768};
  const int64_t stride[4] = {64, 64, 64, 64};
  tile_amx<MB, 2>(w, strips, xb + block0 * 16 * w.k_pad, dest, stride);
  for (int i = 0; i < MB; ++i) {
    const float* gate = out + (MB == 1 ? 0 : i) * 256;
    const float* up = out + (MB == 1 ? 1 : i + 2) * 256;
    silu_mul_tile_rows(gate, up, act + (block0 + i) * 16 * I + (j / 2) * 512 + (j % 2) * 16);
  }
}

void linear_silu_mul(const PackedLinear& w, const float* x, int64_t m, int64_t x_stride, uint16_t* act) {
  TORCH_CHECK(fuses_silu_mul(w), "linear_silu_mul runs bf16 [gate | up] weights of a width in 64s on amx");
  const at::Tensor tiles = amx_activation_tiles(x, m, w.k, x_stride, w.k_pad);
  const uint16_t* xb = reinterpret_cast<const uint16_t*>(tiles.data_ptr());
  const int64_t blocks = (m + 15) / 16, chunk = amx_row_chunk(w.k_pad);
  // threads take pairs of j: one pair fills one 32-k column of the activation tiles, so no two threads share a line
  at::parallel_for(0, w.n / 64, 1, [&](int64_t p0, int64_t p1) {
    configure_bf16_tiles();
    alignas(64) float out[4 * 256];
    for (int64_t first = 0; first < blocks; first += chunk) {
      const int64_t last = std::min(blocks, first + chunk), pairs_end = first + (last - first) / 2 * 2;
      for (int64_t j = 2 * p0; j < 2 * p1; ++j) {
        for (int64_t block = first; block < pairs_end; block += 2) silu_mul_step_amx<2>(w, xb, block, j, out, act);
        if (pairs_end < last) silu_mul_step_amx<1>(w, xb, pairs_end, j, out, act);
      }
    }
  });
}

void linear(const PackedLinear& w, const float* x, int64_t m, int64_t x_stride, float* y, int64_t y_stride) {
  if (m <= 0) return;
  if (w.format == Format::q8_0) return linear_q8_0(w, x, m, x_stride, y, y_stride);
  switch (w.isa) {
    case Isa::amx: return linear_amx(w, x, m, x_stride, y, y_stride);
    case Isa::avx512bf16: return linear_avx512bf16(w, x, m, x_stride, y, y_stride);
    case Isa::avx2: return linear_avx2(w, x, m, x_stride, y, y_stride);
    case Isa::scalar: return linear_scalar(w, x, m, x_stride, y, y_stride);
  }
}

// ---- peak multiply-accumulate rate: independent chains of the path's instruction, operands in registers --

__attribute__((target("avx512f,avx512bw,avx512bf16"))) static double peak_avx512bf16(int64_t iterations) {
  __m512 acc[12];
  for (auto& a : acc) a = _mm512_setzero_ps();
  __m512bh a = (__m512bh)_mm512_set1_epi32(0x3f803f80), b = (__m512bh)_mm512_set1_epi32(0x00010001);
  const Stopwatch clock;
  for (int64_t i = 0; i < iterations; ++i) {
    for (auto& c : acc) c = _mm512_dpbf16_ps(c, a, b);
    __asm__ volatile("" : "+v"(a));
  }
  const double seconds = clock.seconds();
  for (int i = 1; i < 12; ++i) acc[0] = _mm512_add_ps(acc[0], acc[i]);  // every chain is live
  volatile float sink = _mm512_reduce_add_ps(acc[0]);
  (void)sink;
  return double(iterations) * 12 * 32 / seconds;  // 32 multiply-accumulates per vdpbf16ps
}

__attribute__((target("avx2,fma"))) static double peak_avx2(int64_t iterations) {
  __m256 acc[12];
  for (auto& a : acc) a = _mm256_setzero_ps();
  __m256 a = _mm256_set1_ps(1e-7f), b = _mm256_set1_ps(1e-7f);
  const Stopwatch clock;
  for (int64_t i = 0; i < iterations; ++i) {
    for (auto& c : acc) c = _mm256_fmadd_ps(a, b, c);
    __asm__ volatile("" : "+x"(a));
  }
  const double seconds = clock.seconds();
  for (int i = 1; i < 12; ++i) acc[0] = _mm256_add_ps(acc[0], acc[i]);  // every chain is live
  alignas(32) float out[8];
  _mm256_store_ps(out, acc[0]);
  volatile float sink = out[0];
  (void)sink;
  return double(iterations) * 12 * 8 / seconds;
}

static double peak_scalar(int64_t iterations) {
  float acc[8] = {0};
  volatile float a = 1e-7f;
  float av = a;
  const Stopwatch clock;
  for (int64_t i = 0; i < iterations; ++i)
    for (auto& c : acc) c = std::fmaf(av, av, c);
  const double seconds = clock.seconds();
  volatile float sink = acc[0] + acc[1] + acc[2] + acc[3] + acc[4] + acc[5] + acc[6] + acc[7];
  (void)sink;
  return double(iterations) * 8 / seconds;
}

__attribute__((target("amx-tile,amx-bf16,avx512f"))) static double peak_amx(int64_t iterations) {
  configure_bf16_tiles();
  zero_tiles();
  iterations = std::max<int64_t>(1, iterations / 16);
  const Stopwatch clock;
  for (int64_t i = 0; i < iterations; ++i) {  // four independent accumulators, operands in tiles
    _tile_dpbf16ps(0, 4, 5);
    _tile_dpbf16ps(1, 4, 6);
    _tile_dpbf16ps(2, 5, 6);
    _tile_dpbf16ps(3, 6, 5);
  }
  alignas(64) float out[256];
  _tile_stored(0, out, 64);
  const double seconds = clock.seconds();
  volatile float sink = out[0];
  (void)sink;
  return double(iterations) * 4 * 16 * 16 * 32 / seconds;  // 8192 multiply-accumulates per tdpbf16ps
}

double peak_macs_per_second(Isa isa, int64_t iterations) {
  switch (isa) {
    case Isa::amx: return peak_amx(iterations);
    case Isa::avx512bf16: return peak_avx512bf16(iterations);
    case Isa::avx2: return peak_avx2(iterations);
    case Isa::scalar: return peak_scalar(iterations);
  }
  return 0.0;
}

}  // namespace specstand
