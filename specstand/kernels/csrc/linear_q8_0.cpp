// The linear kernel family on Q8_0 weights (int8 values, an fp16 scale per 32 k of a column), three
// instruction paths side by side. It reads about half the bytes of bf16 weights: what decoding is bound by.
//
// Every output element is computed block by block: the block's 32 products are summed into a fresh
// partial, and the partial, times the block's scale, is added to the element's fp32 accumulator (one FMA).
// Same instructions whatever the row count, no split over k, threads split columns only: row i of an
// m-row call is bit-identical to a 1-row call, as for bf16 weights.
//   avx512 (avx512bf16 and amx CPUs, with AVX512-VNNI): integer dot products, so the weights are never
//     widened. Each row's block of 32 activations is put on a 16-bit fixed-point grid whose step is a
//     power of two (2^e, the largest |x| of the block maps to at most 32639: 15-16 bits of it kept, more
//     than bf16's 8) and split in two int8 halves; vpdpbusd sums (q + 128) x half exactly in int32, the
//     offset 128 x sum(x) is taken off, the exact block sum is converted to fp32 (one rounding) and added
//     times d * 2^e (exact).
//   avx2:   the same grid as int16 values; vpmaddwd sums q x v exactly in int32 (q widened to int16).
//   scalar: the same integers in plain C++.
// Every path's block sums are therefore the same integers, and the epilogue the same fp32 operations: a
// Q8_0 linear gives the same bits on every CPU (unlike bf16, where the paths round differently).
#include <ATen/Parallel.h>
#include <ATen/ops/zeros.h>
#include <immintrin.h>

#include <cmath>

#include "linear.h"
#include "tiles.h"

namespace specstand {

static bool vnni_path(Isa isa) {
  static const bool vnni = __builtin_cpu_supports("avx512vnni") && __builtin_cpu_supports("avx512bw");
  return (isa == Isa::avx512bf16 || isa == Isa::amx) && vnni;
}

PackedLinear pack_linear_q8_0(const at::Tensor& q, const at::Tensor& d, Isa isa) {
  TORCH_CHECK(q.dim() == 2 && q.scalar_type() == at::kChar, "pack_linear_q8_0 takes int8 values [n, k]");
  TORCH_CHECK(d.dim() == 2 && d.scalar_type() == at::kHalf && d.size(0) == q.size(0) &&
                  d.size(1) == (q.size(1) + 31) / 32,
              "pack_linear_q8_0 takes fp16 scales [n, ceil(k / 32)]");
  const at::Tensor values = q.contiguous(), block_scales = d.contiguous();
  PackedLinear p;
  p.n = values.size(0);
  p.k = values.size(1);
  p.n_pad = (p.n + 15) / 16 * 16;
  p.k_pad = (p.k + 31) / 32 * 32;
  p.isa = isa;
  p.format = Format::q8_0;
  const int64_t blocks = p.k_pad / 32;
  p.data = at::zeros({p.n_pad * p.k_pad}, at::kChar);  // padded columns and k hold q = 0
  p.scales = at::zeros({p.n_pad * blocks}, at::kHalf);
  auto* dst = p.data.data_ptr<int8_t>();
  auto* scale_dst = reinterpret_cast<uint16_t*>(p.scales.data_ptr());
  p.qbase = dst;
  p.scale_base = scale_dst;
  const auto* src = values.data_ptr<int8_t>();
  const auto* scale_src = reinterpret_cast<const uint16_t*>(block_scales.data_ptr());
  // avx512: k quads, [k_pad / 4][16 columns][4 k] of q + 128 (vpdpbusd's unsigned operand); else k pairs of q
  const bool quads = vnni_path(isa);
  if (quads) std::memset(dst, 128, p.n_pad * p.k_pad);  // padding holds q = 0 too
  at::parallel_for(0, p.n, 64, [&](int64_t begin, int64_t end) {
    for (int64_t col = begin; col < end; ++col) {
      int8_t* strip = dst + (col / 16) * p.k_pad * 16;
      for (int64_t kk = 0; kk < p.k; ++kk) {
        if (quads) {
          strip[(kk / 4) * 64 + (col % 16) * 4 + (kk % 4)] = int8_t(uint8_t(src[col * p.k + kk] + 128));
        } else {
          strip[(kk / 2) * 32 + (col % 16) * 2 + (kk % 2)] = src[col * p.k + kk];
        }
      }
      uint16_t* scales = scale_dst + (col / 16) * blocks * 16;
      for (int64_t b = 0; b < blocks; ++b) scales[b * 16 + col % 16] = scale_src[col * blocks + b];
    }
  });
  return p;
}

// ---- avx512 (VNNI): R rows x NB strips; per element two int32 partials (high and low halves) and the sum ----
// The rows' activations on their fixed-point grids: per row, k_pad high and low int8 halves, and per block
// the step exponent and 128 x the sum of the fixed-point values (the offset the unsigned weights add).
struct FixedPointRows {
  AlignedVector<int8_t> high, low;  // AMX-INT8 loads 16-row tiles of them
  std::vector<float> step;       // 2^e per row and block
  std::vector<int32_t> offset;   // 128 x sum of the block's fixed-point values
};

// One row's blocks onto their grids, 32 values at a time (two zmm): largest |x|, the step 2^e, the values
// as integers (x * 2^-e is exact, then rounded to nearest even), their halves and their sum.
__attribute__((target("avx512f,avx512bw"))) static void fixed_point_row(const float* x, int64_t k, int64_t blocks,
                                                                        int8_t* high, int8_t* low, float* steps,
                                                                        int32_t* offsets) {
  const __m512i byte = _mm512_set1_epi32(255), half = _mm512_set1_epi32(128);
  for (int64_t block = 0; block < blocks; ++block) {
    const int64_t k0 = block * 32;
    const __mmask16 m0 = k0 + 16 <= k ? __mmask16(0xffff) : __mmask16((1u << std::max<int64_t>(0, k - k0)) - 1);
    const __mmask16 m1 = k0 + 32 <= k ? __mmask16(0xffff) : __mmask16((1u << std::max<int64_t>(0, k - k0 - 16)) - 1);
    const __m512 v0 = _mm512_maskz_loadu_ps(m0, x + k0), v1 = _mm512_maskz_loadu_ps(m1, x + k0 + 16);
    // NaN or infinity anywhere: x * 0 is NaN there
    const float probe = _mm512_reduce_add_ps(_mm512_add_ps(_mm512_mul_ps(v0, _mm512_setzero_ps()),
                                                           _mm512_mul_ps(v1, _mm512_setzero_ps())));
    if (probe != 0.0f) {  // the block's sums come out NaN, as a float dot product's would
      steps[block] = NAN;
      continue;
    }
    const float largest = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(v0), _mm512_abs_ps(v1)));
    if (largest == 0.0f) continue;  // step 0: the block adds nothing
    int e;
    std::frexp(largest / 32639.0f, &e);  // 2^e >= largest / 32639 > 2^(e - 1): at most 32639 steps
    const __m512 inverse = _mm512_set1_ps(std::ldexp(1.0f, -e));
    const __m512i i0 = _mm512_cvtps_epi32(_mm512_mul_ps(v0, inverse));  // round to nearest even
    const __m512i i1 = _mm512_cvtps_epi32(_mm512_mul_ps(v1, inverse));
    const __m512i l0 = _mm512_sub_epi32(_mm512_and_si512(_mm512_add_epi32(i0, half), byte), half);
    const __m512i l1 = _mm512_sub_epi32(_mm512_and_si512(_mm512_add_epi32(i1, half), byte), half);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(low + k0), _mm512_cvtepi32_epi8(l0));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(low + k0 + 16), _mm512_cvtepi32_epi8(l1));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(high + k0), _mm512_cvtepi32_epi8(_mm512_srai_epi32(_mm512_sub_epi32(i0, l0), 8)));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(high + k0 + 16),
                     _mm512_cvtepi32_epi8(_mm512_srai_epi32(_mm512_sub_epi32(i1, l1), 8)));
    steps[block] = std::ldexp(1.0f, e);
    offsets[block] = 128 * _mm512_reduce_add_epi32(_mm512_add_epi32(i0, i1));
  }
}

// Rows past m (up to padded_rows) are zeros: AMX loads whole 16-row blocks.
static FixedPointRows fixed_point_rows(const float* x, int64_t m, int64_t k, int64_t x_stride, int64_t k_pad,
                                       int64_t padded_rows) {
  const int64_t blocks = k_pad / 32;
  FixedPointRows rows{AlignedVector<int8_t>(padded_rows * k_pad, 0), AlignedVector<int8_t>(padded_rows * k_pad, 0),
                      std::vector<float>(padded_rows * blocks, 0.0f), std::vector<int32_t>(padded_rows * blocks, 0)};
  at::parallel_for(0, m, 8, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r)
      fixed_point_row(x + r * x_stride, k, blocks, rows.high.data() + r * k_pad, rows.low.data() + r * k_pad,
                      rows.step.data() + r * blocks, rows.offset.data() + r * blocks);
  });
  return rows;
}

// The fp32 accumulators wait in L1 between blocks (loaded, updated, stored once per block): in registers
// beside the 2 x R x NB integer partials they made the compiler spill inside the k loop.
template <int R, int NB>
__attribute__((target("avx512f,avx512bw,avx512vnni"))) static void tile_q8_avx512(
    const PackedLinear& w, int64_t s0, const FixedPointRows& xq, int64_t r0, float* y, int64_t ys) {
  const int64_t blocks = w.k_pad / 32;
  alignas(64) float acc[R][NB][16] = {};
  const int8_t* highs[R];
  const int8_t* lows[R];
  for (int r = 0; r < R; ++r) {
    highs[r] = xq.high.data() + (r0 + r) * w.k_pad;
    lows[r] = xq.low.data() + (r0 + r) * w.k_pad;
  }
  const int8_t* strips[NB];
  for (int b = 0; b < NB; ++b) strips[b] = w.q_strip(s0 + b);
  for (int64_t block = 0; block < blocks; ++block) {
    __m512i high[R][NB], low[R][NB];
    for (int r = 0; r < R; ++r)
      for (int b = 0; b < NB; ++b) high[r][b] = low[r][b] = _mm512_setzero_si512();
#pragma GCC unroll 8
    for (int quad = 0; quad < 8; ++quad) {
      const int64_t k = block * 32 + quad * 4;
      __m512i wv[NB];
      for (int b = 0; b < NB; ++b) wv[b] = _mm512_load_si512(strips[b] + k * 16);
      for (int r = 0; r < R; ++r) {
        int32_t h, l;
        std::memcpy(&h, highs[r] + k, 4);
        std::memcpy(&l, lows[r] + k, 4);
        const __m512i hv = _mm512_set1_epi32(h), lv = _mm512_set1_epi32(l);
        for (int b = 0; b < NB; ++b) {
          high[r][b] = _mm512_dpbusd_epi32(high[r][b], wv[b], hv);
          low[r][b] = _mm512_dpbusd_epi32(low[r][b], wv[b], lv);
        }
      }
    }
    for (int b = 0; b < NB; ++b) {
      const uint16_t* scales = w.scale_strip(s0 + b) + block * 16;
      const __m512 d = _mm512_cvtph_ps(_mm256_load_si256(reinterpret_cast<const __m256i*>(scales)));
      for (int r = 0; r < R; ++r) {
        const int64_t at = (r0 + r) * blocks + block;
        const __m512i exact = _mm512_sub_epi32(_mm512_add_epi32(_mm512_slli_epi32(high[r][b], 8), low[r][b]),
                                               _mm512_set1_epi32(xq.offset[at]));
        const __m512 scale = _mm512_mul_ps(d, _mm512_set1_ps(xq.step[at]));  // exact: times a power of two
        _mm512_store_ps(acc[r][b], _mm512_fmadd_ps(_mm512_cvtepi32_ps(exact), scale, _mm512_load_ps(acc[r][b])));
      }
    }
  }
  for (int r = 0; r < R; ++r)
    for (int b = 0; b < NB; ++b) {
      const int64_t col = (s0 + b) * 16, valid = std::min<int64_t>(16, w.n - col);
      _mm512_mask_storeu_ps(y + r * ys + col, (__mmask16)((1u << std::max<int64_t>(valid, 0)) - 1),
                            _mm512_load_ps(acc[r][b]));
    }
}

// ---- amx (AMX-INT8): 16 rows x 2 strips a tile step, for calls of many rows ---------------------------------
// tdpbsud sums the same signed halves times unsigned weights as vpdpbusd, exactly in int32, so a block's
// integer sums are the same numbers whichever instruction computed them; the block epilogue below is the
// avx512 tile's, op for op. Rows computed here are therefore bit-identical to rows computed there.
__attribute__((target("amx-tile,amx-int8,avx512f"))) static void configure_int8_tiles() {
  TORCH_CHECK(amx_permitted(), "Linux did not grant this process the AMX tile registers");
  AmxTileConfig config;
  for (int t = 0; t < 4; ++t) {  // C tiles 0-3: 16 x 16 int32 (high and low halves of 2 strips)
    config.rows[t] = 16;
    config.colsb[t] = 64;
  }
  for (int t = 4; t < 6; ++t) {  // A tiles 4-5: 16 rows x 32 int8 (one block of the high, the low halves)
    config.rows[t] = 16;
    config.colsb[t] = 32;
  }
  config.rows[6] = 8;  // B tile 6: 8 k quads x 16 columns x 4 (one block of a strip)
  config.colsb[6] = 64;
  __asm__ volatile("" : : "r"(&config) : "memory");  // as in linear.cpp: ldtilecfg reads the stores above
  _tile_loadconfig(&config);
}

// Integer block sums of one 16-row block and NB (<= 2) strips into sums [NB][2 halves][16 rows][16 columns].
template <int NB>
__attribute__((target("amx-tile,amx-int8,avx512f"))) static void block_sums_amx(const PackedLinear& w, int64_t s0,
                                                                                const int8_t* high, const int8_t* low,
                                                                                int64_t xs, int64_t block, int32_t* sums) {
  _tile_zero(0);
  _tile_zero(1);
  if (NB > 1) {
    _tile_zero(2);
    _tile_zero(3);
  }
  _tile_loadd(4, high + block * 32, xs);
  _tile_loadd(5, low + block * 32, xs);
  _tile_loadd(6, w.q_strip(s0) + block * 8 * 64, 64);
  _tile_dpbsud(0, 4, 6);
  _tile_dpbsud(1, 5, 6);
  if (NB > 1) {
    _tile_loadd(6, w.q_strip(s0 + 1) + block * 8 * 64, 64);
    _tile_dpbsud(2, 4, 6);
    _tile_dpbsud(3, 5, 6);
  }
  _tile_stored(0, sums, 64);
  _tile_stored(1, sums + 256, 64);
  if (NB > 1) {
    _tile_stored(2, sums + 512, 64);
    _tile_stored(3, sums + 768, 64);
  }
}

// One strip group (nb strips from s0) for every 16-row block of the call.
template <int NB>
__attribute__((target("amx-tile,amx-int8,avx512f,avx512bw,avx512vnni"))) static void strip_group_q8_amx(
    const PackedLinear& w, const FixedPointRows& xq, int64_t m, int64_t s0, int64_t nb, float* y, int64_t y_stride) {
  const int64_t blocks = w.k_pad / 32;
  alignas(64) int32_t sums[NB * 2 * 256];
  alignas(64) float acc[16 * NB * 16];
  for (int64_t r0 = 0; r0 < m; r0 += 16) {
    const int64_t rows = std::min<int64_t>(16, m - r0);
    std::fill(acc, acc + 16 * NB * 16, 0.0f);
    for (int64_t block = 0; block < blocks; ++block) {
      const int8_t* high = xq.high.data() + r0 * w.k_pad;
      const int8_t* low = xq.low.data() + r0 * w.k_pad;
      if (nb == 2) {
        block_sums_amx<2>(w, s0, high, low, w.k_pad, block, sums);
      } else {
        block_sums_amx<1>(w, s0, high, low, w.k_pad, block, sums);
      }
      for (int64_t b = 0; b < nb; ++b) {
        const uint16_t* scales = w.scale_strip(s0 + b) + block * 16;
        const __m512 d = _mm512_cvtph_ps(_mm256_load_si256(reinterpret_cast<const __m256i*>(scales)));
        for (int64_t r = 0; r < rows; ++r) {
          const int64_t at = (r0 + r) * blocks + block;
          const __m512i hi = _mm512_load_si512(sums + b * 512 + r * 16);
          const __m512i lo = _mm512_load_si512(sums + b * 512 + 256 + r * 16);
          const __m512i exact =
              _mm512_sub_epi32(_mm512_add_epi32(_mm512_slli_epi32(hi, 8), lo), _mm512_set1_epi32(xq.offset[at]));
          const __m512 scale = _mm512_mul_ps(d, _mm512_set1_ps(xq.step[at]));
          float* a = acc + r * NB * 16 + b * 16;
          _mm512_store_ps(a, _mm512_fmadd_ps(_mm512_cvtepi32_ps(exact), scale, _mm512_load_ps(a)));
        }
      }
    }
    for (int64_t b = 0; b < nb; ++b) {
      const int64_t col = (s0 + b) * 16, valid = std::min<int64_t>(16, w.n - col);
      for (int64_t r = 0; r < rows; ++r)
        std::memcpy(y + (r0 + r) * y_stride + col, acc + r * NB * 16 + b * 16, valid * sizeof(float));
    }
  }
}

static void linear_q8_amx(const PackedLinear& w, const FixedPointRows& xq, int64_t m, float* y, int64_t y_stride) {
  constexpr int NB = 2;
  const int64_t strips = w.n_pad / 16;
  at::parallel_for(0, (strips + NB - 1) / NB, 1, [&](int64_t g0, int64_t g1) {
    configure_int8_tiles();  // tile state is per thread
    for (int64_t g = g0; g < g1; ++g)
      strip_group_q8_amx<NB>(w, xq, m, g * NB, std::min<int64_t>(NB, strips - g * NB), y, y_stride);
  });
}

// ---- avx2 and scalar: the same grid as int16 values, q x v summed exactly in int32 ------------------------
// vpmaddwd multiplies int16 pairs and adds each pair's two products: a block's sum is the same integer the
// avx512 path gets from its halves, and the epilogue is the same fp32 ops, so every path gives the same bits.
struct FixedPointValues {
  std::vector<int16_t> values;  // per row, k_pad values on the row's grids (|v| <= 32639)
  std::vector<float> step;      // 2^e per row and block (NaN where the block is not finite, 0 where zero)
};

// The grid rule of fixed_point_row for one block of x[k0, k1): its step (NaN where a value is not finite, 0 where
// all are zero) and its values.
static void fixed_point_block(const float* x, int64_t count, int16_t* values, float* step) {
  float largest = 0.0f;
  bool finite = true;
  for (int64_t i = 0; i < count; ++i) {
    finite = finite && std::isfinite(x[i]);
    largest = std::max(largest, std::fabs(x[i]));
  }
  if (!finite) {
    *step = NAN;
  } else if (largest > 0.0f) {
    int e;
    std::frexp(largest / 32639.0f, &e);
    *step = std::ldexp(1.0f, e);
    const float inverse = std::ldexp(1.0f, -e);
    for (int64_t i = 0; i < count; ++i) values[i] = int16_t(std::nearbyint(x[i] * inverse));
  }
}

// The same rule on a whole block of 32 with AVX2: vcvtps2dq rounds to nearest even as nearbyint does, and x * 2^-e
// is exact, so the integers and the step are the scalar rule's (the prompt rows of a linear are many: the scalar
// loop took longer than the products).
__attribute__((target("avx2"))) static void fixed_point_block_avx2(const float* x, int16_t* values, float* step) {
  __m256 v[4], probe = _mm256_setzero_ps(), largest = _mm256_setzero_ps();
  const __m256 magnitude = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
  for (int i = 0; i < 4; ++i) {
    v[i] = _mm256_loadu_ps(x + 8 * i);
    probe = _mm256_add_ps(probe, _mm256_mul_ps(v[i], _mm256_setzero_ps()));  // NaN where any value is not finite
    largest = _mm256_max_ps(largest, _mm256_and_ps(v[i], magnitude));
  }
  if (_mm256_movemask_ps(_mm256_cmp_ps(probe, probe, _CMP_UNORD_Q))) {
    *step = NAN;
    return;
  }
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, largest);
  const float top = *std::max_element(lanes, lanes + 8);
  if (top == 0.0f) return;
  int e;
  std::frexp(top / 32639.0f, &e);
  *step = std::ldexp(1.0f, e);
  const __m256 inverse = _mm256_set1_ps(std::ldexp(1.0f, -e));
  for (int i = 0; i < 4; i += 2) {  // |values| <= 32639: packing saturates nothing; the permute undoes its lane order
    const __m256i low = _mm256_cvtps_epi32(_mm256_mul_ps(v[i], inverse));
    const __m256i high = _mm256_cvtps_epi32(_mm256_mul_ps(v[i + 1], inverse));
    const __m256i packed = _mm256_permute4x64_epi64(_mm256_packs_epi32(low, high), 0xd8);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(values + 8 * i), packed);
  }
}

// `isa` scalar keeps the scalar rule on every block (so the paths' equal bits are tested against it).
static FixedPointValues fixed_point_values(const float* x, int64_t m, int64_t k, int64_t x_stride, int64_t k_pad,
                                           Isa isa) {
  static const bool has_avx2 = cpu_has(Isa::avx2);
  const bool avx2 = has_avx2 && isa != Isa::scalar;
  const int64_t blocks = k_pad / 32;
  FixedPointValues rows{std::vector<int16_t>(m * k_pad, 0), std::vector<float>(m * blocks, 0.0f)};
  at::parallel_for(0, m, 8, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r)
      for (int64_t block = 0; block < blocks; ++block) {
        const int64_t k0 = block * 32, count = std::min<int64_t>(k, k0 + 32) - k0;
        int16_t* values = rows.values.data() + r * k_pad + k0;
        float* step = rows.step.data() + r * blocks + block;
        if (avx2 && count == 32) {
          fixed_point_block_avx2(x + r * x_stride + k0, values, step);
        } else {
          fixed_point_block(x + r * x_stride + k0, count, values, step);
        }
      }
  });
  return rows;
}

// R rows x NB strips; a strip's 16 columns are two ymm of int32 block sums per row. As linear.cpp's avx2 tiles:
// rows first (R >= 2: each k pair's weights widened to int16 once, each row's pair (x[2p], x[2p + 1]) broadcast
// once and meeting all of them) or columns first (1 row: its pair in a register, each weight widened as used).
// Measured on Zen 4 (weights in L1, thread CPU time; vpmaddwd + vpaddd peak about 95 GMAC/s a core): 4 x 1 80,
// 3 x 1 78, 2 x 2 73, 1 x 4 (columns first) 62; 5 x 1 and 6 x 1 spill (48, 56).
// 16 int8 at `at` (8 columns' (k even, k odd) pairs of one k pair) widened to int16.
__attribute__((target("avx2"), always_inline)) static inline __m256i widened_q8(const int8_t* at) {
  return _mm256_cvtepi8_epi16(_mm_load_si128(reinterpret_cast<const __m128i*>(at)));
}

// A row's activation pair (x[2p], x[2p + 1]) in every 32-bit lane.
__attribute__((target("avx2"), always_inline)) static inline __m256i broadcast_pair(const int16_t* at) {
  int32_t both;
  std::memcpy(&both, at, 4);
  return _mm256_set1_epi32(both);
}

template <int R, int NB>
__attribute__((target("avx2,fma,f16c"))) static void tile_q8_avx2(const PackedLinear& w, int64_t s0,
                                                                  const FixedPointValues& xv, int64_t r0, float* y,
                                                                  int64_t ys) {
  constexpr bool rows_first = R >= 2;
  static_assert(rows_first ? 2 * R * NB + 2 * NB + 1 <= 16 : NB <= 4, "sums and operands in 16 ymm");
  const int64_t blocks = w.k_pad / 32;
  alignas(32) float acc[R][NB][16] = {};
  const int16_t* rows[R];
  for (int r = 0; r < R; ++r) rows[r] = xv.values.data() + (r0 + r) * w.k_pad;
  const int8_t* strips[NB];
  for (int b = 0; b < NB; ++b) strips[b] = w.q_strip(s0 + b);
  for (int64_t block = 0; block < blocks; ++block) {
    __m256i sums[R][NB][2];
    for (int r = 0; r < R; ++r)
      for (int b = 0; b < NB; ++b) sums[r][b][0] = sums[r][b][1] = _mm256_setzero_si256();
#pragma GCC unroll 4
    for (int pair = 0; pair < 16; ++pair) {
      const int64_t p = block * 16 + pair;
      if constexpr (rows_first) {
        __m256i q[NB][2];
        for (int b = 0; b < NB; ++b)
          for (int h = 0; h < 2; ++h) q[b][h] = widened_q8(strips[b] + p * 32 + h * 16);
        for (int r = 0; r < R; ++r) {
          const __m256i xv2 = broadcast_pair(rows[r] + 2 * p);
          for (int b = 0; b < NB; ++b)
            for (int h = 0; h < 2; ++h)
              sums[r][b][h] = _mm256_add_epi32(sums[r][b][h], _mm256_madd_epi16(q[b][h], xv2));
        }
      } else {
        const __m256i xv2 = broadcast_pair(rows[0] + 2 * p);
        for (int b = 0; b < NB; ++b)
          for (int h = 0; h < 2; ++h)
            sums[0][b][h] =
                _mm256_add_epi32(sums[0][b][h], _mm256_madd_epi16(widened_q8(strips[b] + p * 32 + h * 16), xv2));
      }
    }
    for (int b = 0; b < NB; ++b)
      for (int h = 0; h < 2; ++h) {
        const __m256 d = _mm256_cvtph_ps(
            _mm_load_si128(reinterpret_cast<const __m128i*>(w.scale_strip(s0 + b) + block * 16 + h * 8)));
        for (int r = 0; r < R; ++r) {
          const __m256 scale = _mm256_mul_ps(d, _mm256_set1_ps(xv.step[(r0 + r) * blocks + block]));
          float* a = acc[r][b] + h * 8;
          _mm256_store_ps(a, _mm256_fmadd_ps(_mm256_cvtepi32_ps(sums[r][b][h]), scale, _mm256_load_ps(a)));
        }
      }
  }
  for (int r = 0; r < R; ++r)
    for (int b = 0; b < NB; ++b) {
      const int64_t col = (s0 + b) * 16;
      for (int64_t c = 0; c < std::min<int64_t>(16, w.n - col); ++c) y[r * ys + col + c] = acc[r][b][c];
    }
}

// The same integers and the same fp32 ops in plain C++.
static void tile_q8_scalar(const PackedLinear& w, int64_t s, const FixedPointValues& xv, int64_t rows, float* y,
                           int64_t ys) {
  const int64_t blocks = w.k_pad / 32;
  const int8_t* strip = w.q_strip(s);
  const uint16_t* scales = w.scale_strip(s);
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = 0; c < 16 && s * 16 + c < w.n; ++c) {
      float acc = 0.0f;
      for (int64_t block = 0; block < blocks; ++block) {
        int32_t sum = 0;
        for (int64_t kk = block * 32; kk < block * 32 + 32; ++kk)
          sum += int32_t(strip[(kk / 2) * 32 + c * 2 + kk % 2]) * xv.values[r * w.k_pad + kk];
        const float scale = fp16_to_float(scales[block * 16 + c]) * xv.step[r * blocks + block];
        acc = std::fmaf(float(sum), scale, acc);
      }
      y[r * ys + s * 16 + c] = acc;
    }
}

// Few rows on vpdpbusd; from AMX_ROWS rows on AMX-INT8 where the CPU has it (the same bits either way).
static constexpr int64_t AMX_ROWS = 16;

static bool amx_int8() {
  static const bool has = __builtin_cpu_supports("amx-int8") && cpu_has(Isa::amx);
  return has;
}

static void linear_q8_avx512(const PackedLinear& w, const float* x, int64_t m, int64_t x_stride, float* y,
                             int64_t y_stride) {
  constexpr int NB = 3;  // 4 rows x 3 strips: 24 integer partials + 3 weights + 2 activations of 32 zmm
  const bool on_amx = w.isa == Isa::amx && m >= AMX_ROWS && amx_int8();
  const FixedPointRows xq = fixed_point_rows(x, m, w.k, x_stride, w.k_pad, on_amx ? (m + 15) / 16 * 16 : m);
  if (on_amx) return linear_q8_amx(w, xq, m, y, y_stride);
  for_strip_groups<NB>(w, [&](int64_t s0, int64_t nb) {
    run_rows<4>(m, [&](int64_t r, auto rows) {
      constexpr int R = decltype(rows)::value;
      switch (nb) {
        case 3: tile_q8_avx512<R, 3>(w, s0, xq, r, y + r * y_stride, y_stride); break;
        case 2: tile_q8_avx512<R, 2>(w, s0, xq, r, y + r * y_stride, y_stride); break;
        default: tile_q8_avx512<R, 1>(w, s0, xq, r, y + r * y_stride, y_stride); break;
      }
    });
  });
}

// 4 rows a tile, fewer rows over more strips (tile_q8_avx2's measured shapes), threads on groups of 4 strips.
template <int R>
constexpr int q8_avx2_strips() {
  return R >= 3 ? 1 : R == 2 ? 2 : 4;
}

static void linear_q8_avx2(const PackedLinear& w, const float* x, int64_t m, int64_t x_stride, float* y,
                           int64_t y_stride) {
  const FixedPointValues xv = fixed_point_values(x, m, w.k, x_stride, w.k_pad, w.isa);
  for_strip_groups<4>(w, [&](int64_t s0, int64_t nb) {
    run_rows<4>(m, [&](int64_t r, auto rows) {
      constexpr int R = decltype(rows)::value, NB = q8_avx2_strips<R>();
      int64_t s = s0;
      for (; s + NB <= s0 + nb; s += NB) tile_q8_avx2<R, NB>(w, s, xv, r, y + r * y_stride, y_stride);
      for (; s < s0 + nb; ++s) tile_q8_avx2<R, 1>(w, s, xv, r, y + r * y_stride, y_stride);
    });
  });
}

void linear_q8_0(const PackedLinear& w, const float* x, int64_t m, int64_t x_stride, float* y, int64_t y_stride) {
  if (m <= 0) return;
  if (vnni_path(w.isa)) return linear_q8_avx512(w, x, m, x_stride, y, y_stride);
  if (w.isa != Isa::scalar) return linear_q8_avx2(w, x, m, x_stride, y, y_stride);  // every AVX-512 CPU has AVX2
  const FixedPointValues xv = fixed_point_values(x, m, w.k, x_stride, w.k_pad, w.isa);
  for_strip_groups<1>(w, [&](int64_t s, int64_t) { tile_q8_scalar(w, s, xv, m, y, y_stride); });
}

// ---- peak multiply-accumulate rate of the q8_0 paths, counted as this kernel uses them: two int8 products
// (the high and the low half) make one multiply-accumulate of a weight and an activation ----------------------
__attribute__((target("avx512f,avx512bw,avx512vnni"))) static double peak_q8_vnni(int64_t iterations) {
  __m512i acc[12];
  for (auto& a : acc) a = _mm512_setzero_si512();
  __m512i a = _mm512_set1_epi32(0x01010101), b = _mm512_set1_epi32(0x01010101);
  const Stopwatch clock;
  for (int64_t i = 0; i < iterations; ++i) {
    for (auto& c : acc) c = _mm512_dpbusd_epi32(c, a, b);
    __asm__ volatile("" : "+v"(a));
  }
  const double seconds = clock.seconds();
  for (int i = 1; i < 12; ++i) acc[0] = _mm512_add_epi32(acc[0], acc[i]);  // every chain is live
  volatile int sink = _mm512_reduce_add_epi32(acc[0]);
  (void)sink;
  return double(iterations) * 12 * 32 / seconds;  // 64 int8 products per vpdpbusd
}

// avx2: vpmaddwd (16 int16 products, summed in pairs) and the vpaddd that accumulates it, as a tile meets them:
// 3 activations x 2 weights into 6 sums. The activations pass through an empty asm each step, so the compiler
// can neither hoist nor share a product (one product for every chain is what a plainer loop measured).
__attribute__((target("avx2"))) static double peak_q8_avx2(int64_t iterations) {
  __m256i acc[6];
  for (auto& a : acc) a = _mm256_setzero_si256();
  __m256i x0 = _mm256_set1_epi32(1), x1 = _mm256_set1_epi32(2), x2 = _mm256_set1_epi32(3);
  const __m256i w0 = _mm256_set1_epi32(0x00010001), w1 = _mm256_set1_epi32(0x00020001);
  const Stopwatch clock;
  for (int64_t i = 0; i < iterations * 2; ++i) {
    __asm__ volatile("" : "+x"(x0), "+x"(x1), "+x"(x2));
    acc[0] = _mm256_add_epi32(acc[0], _mm256_madd_epi16(x0, w0));
    acc[1] = _mm256_add_epi32(acc[1], _mm256_madd_epi16(x0, w1));
    acc[2] = _mm256_add_epi32(acc[2], _mm256_madd_epi16(x1, w0));
    acc[3] = _mm256_add_epi32(acc[3], _mm256_madd_epi16(x1, w1));
    acc[4] = _mm256_add_epi32(acc[4], _mm256_madd_epi16(x2, w0));
    acc[5] = _mm256_add_epi32(acc[5], _mm256_madd_epi16(x2, w1));
  }
  const double seconds = clock.seconds();
  for (int i = 1; i < 6; ++i) acc[0] = _mm256_add_epi32(acc[0], acc[i]);  // every chain is live
  alignas(32) int32_t out[8];
  _mm256_store_si256(reinterpret_cast<__m256i*>(out), acc[0]);
  volatile int sink = out[0];
  (void)sink;
  return double(iterations) * 2 * 6 * 16 / seconds;  // 16 multiply-accumulates per vpmaddwd
}

__attribute__((target("amx-tile,amx-int8,avx512f"))) static double peak_q8_amx(int64_t iterations) {
  configure_int8_tiles();
  zero_tiles();
  iterations = std::max<int64_t>(1, iterations / 16);
  const Stopwatch clock;
  for (int64_t i = 0; i < iterations; ++i) {  // four independent accumulators, one block (32 k) each, as used
    _tile_dpbsud(0, 4, 6);
    _tile_dpbsud(1, 5, 6);
    _tile_dpbsud(2, 4, 6);
    _tile_dpbsud(3, 5, 6);
  }
  alignas(64) int32_t out[256];
  _tile_stored(0, out, 64);
  const double seconds = clock.seconds();
  volatile int sink = out[0];
  (void)sink;
  return double(iterations) * 4 * 16 * 16 * 32 / 2 / seconds;  // 16 rows x 16 columns x 32 k int8 products
}

double peak_macs_per_second_q8_0(Isa isa, bool tiles, int64_t iterations) {
  if (vnni_path(isa)) return tiles && isa == Isa::amx && amx_int8() ? peak_q8_amx(iterations) : peak_q8_vnni(iterations);
  return isa == Isa::scalar ? peak_macs_per_second(Isa::scalar, iterations) : peak_q8_avx2(iterations);
}

}  // namespace specstand
