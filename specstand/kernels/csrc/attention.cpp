// Decode/verify attention over a bf16 cache, four paths side by side:
//   amx (head_dim 32, 64 or 128): queries and softmax weights rounded to bf16, tdpbf16ps for q.k and p.v
//        with fp32 accumulation, softmax in fp32. A request's query vectors (its rows x the heads sharing a
//        kv head) fill 16-row tiles; each element of a tile product depends on its own row alone, and keys
//        past a row's length weigh exactly 0, so which rows share a tile never changes a row's bits.
//   avx512bf16 (head_dim 32, 64 or 128): the same roundings and tile layouts, the products by vdpbf16ps, one
//        chain per element over the dim pairs (q.k) or key pairs (p.v) in order, whatever else shares the tile.
//   avx512 (other widths on amx and avx512bf16): fp32 FMA over keys widened exactly on load.
//   avx2 (head_dim a multiple of 8): fp32 FMA with (row, head) pairs in the lanes (up to 48 pairs of a request
//        sharing each block of keys and values widened to fp32 in L1), or, for at most 6 pairs (a decoding
//        row), keys in the lanes; both make each score, sum and weighted value the same way.
//   portable: 8-lane vectors (common.h) elsewhere.
// Every sum has a fixed order that depends on the row's own cache length only, so a row computes the same
// bits alone or beside other rows. Tasks group a request's rows per kv head, so its cache is read from
// memory about once a pass.
#include "attention.h"

#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <limits>
#include <vector>

#include "common.h"
#include "tiles.h"

namespace specstand {

// ---- avx512: scores for 16 keys at once, values accumulated in registers ----------------------------

// out[i] = sum of the 16 lanes of v[i], by a fixed tree of in-register shuffles and adds.
__attribute__((target("avx512f"), always_inline)) static inline __m512 sum_lanes16(const __m512* v) {
  __m512 pairs[8], quads[4];
  for (int i = 0; i < 8; ++i)  // per 128-bit block: [a0+a2, b0+b2, a1+a3, b1+b3]
    pairs[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]), _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
  for (int i = 0; i < 4; ++i) {  // per 128-bit block: the block sums of four inputs
    const __m512d x = _mm512_castps_pd(pairs[2 * i]), y = _mm512_castps_pd(pairs[2 * i + 1]);
    quads[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(x, y)), _mm512_castpd_ps(_mm512_unpackhi_pd(x, y)));
  }
  const __m512 low = _mm512_add_ps(_mm512_shuffle_f32x4(quads[0], quads[1], _MM_SHUFFLE(2, 0, 2, 0)),
                                   _mm512_shuffle_f32x4(quads[0], quads[1], _MM_SHUFFLE(3, 1, 3, 1)));
  const __m512 high = _mm512_add_ps(_mm512_shuffle_f32x4(quads[2], quads[3], _MM_SHUFFLE(2, 0, 2, 0)),
                                    _mm512_shuffle_f32x4(quads[2], quads[3], _MM_SHUFFLE(3, 1, 3, 1)));
  return _mm512_add_ps(_mm512_shuffle_f32x4(low, high, _MM_SHUFFLE(2, 0, 2, 0)),
                       _mm512_shuffle_f32x4(low, high, _MM_SHUFFLE(3, 1, 3, 1)));
}

// 16 bf16 values widened to fp32.
__attribute__((target("avx512f"), always_inline)) static inline __m512 load16_bf16(const uint16_t* p) {
  const __m512i wide = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  return _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16));
}

// H heads' weighted sums of values (acc in registers), scaled by their softmax denominators.
template <int DC, int H>
__attribute__((target("avx512f"))) static void weigh_values16(const float* weights, int64_t padded,
                                                             const float* inverse_sum, float* out, int64_t slot,
                                                             int64_t kv, int64_t length, const CacheView& cache) {
  __m512 acc[H][DC];
  for (int h = 0; h < H; ++h)
    for (int c = 0; c < DC; ++c) acc[h][c] = _mm512_setzero_ps();
  for (int64_t j = 0; j < length; ++j) {
    const uint16_t* value = cache.value(slot, kv, j);
    __m512 v[DC];
    for (int c = 0; c < DC; ++c) v[c] = load16_bf16(value + 16 * c);
    for (int h = 0; h < H; ++h) {
      const __m512 w = _mm512_set1_ps(weights[h * padded + j]);
      for (int c = 0; c < DC; ++c) acc[h][c] = _mm512_fmadd_ps(w, v[c], acc[h][c]);
    }
  }
  for (int h = 0; h < H; ++h)
    for (int c = 0; c < DC; ++c)
      _mm512_storeu_ps(out + h * DC * 16 + 16 * c, _mm512_mul_ps(acc[h][c], _mm512_set1_ps(inverse_sum[h])));
}

template <int DC, int H>
static void weigh_values16_heads(const float* weights, int64_t padded, const float* inverse_sum, float* out,
                                 int64_t heads, int64_t slot, int64_t kv, int64_t length, const CacheView& cache) {
  int64_t h = 0;
  for (; h + H <= heads; h += H)
    weigh_values16<DC, H>(weights + h * padded, padded, inverse_sum + h, out + h * DC * 16, slot, kv, length, cache);
  if constexpr (H > 1) {
    if (h < heads)
      weigh_values16_heads<DC, H - 1>(weights + h * padded, padded, inverse_sum + h, out + h * DC * 16, heads - h,
                                      slot, kv, length, cache);
  }
}

// Softmax numerators of one row of (scaled) scores, in place: exp(x - max) over its first `length` keys and 0
// in the rest of the last 16-key block; returns 1 / their sum (16 lanes over the keys, then a fixed tree).
__attribute__((target("avx512f"))) static float softmax_numerators16(float* s, int64_t length) {
  const int64_t padded = (length + 15) / 16 * 16;
  const __mmask16 tail = (__mmask16)((1u << (length - (padded - 16))) - 1);  // the last block's real keys
  __m512 top = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  for (int64_t block = 0; block < padded; block += 16)
    top = _mm512_mask_max_ps(top, block + 16 == padded ? tail : (__mmask16)0xffff, top, _mm512_loadu_ps(s + block));
  const v16f top_v = v16_splat(_mm512_reduce_max_ps(top));
  __m512 total = _mm512_setzero_ps();
  for (int64_t block = 0; block < padded; block += 16) {
    v16f x;
    std::memcpy(&x, s + block, sizeof(x));
    const v16f e = vec_exp(x - top_v);
    __m512 weight;
    std::memcpy(&weight, &e, sizeof(e));
    weight = _mm512_maskz_mov_ps(block + 16 == padded ? tail : (__mmask16)0xffff, weight);  // past the end: 0
    _mm512_storeu_ps(s + block, weight);
    total = _mm512_add_ps(total, weight);
  }
  v16f t;
  std::memcpy(&t, &total, sizeof(t));
  return 1.0f / v16_sum(t);
}

// The heads of one query row that share kv head `kv`, head_dim = 16 * DC.
template <int DC>
__attribute__((target("avx512f"))) static void attend_group16(const float* q, float* out, int64_t group,
                                                             int64_t slot, int64_t kv, int64_t length,
                                                             const CacheView& cache, float scale,
                                                             std::vector<float>& scores) {
  const int64_t padded = (length + 15) / 16 * 16;
  scores.resize(group * padded);
  const __m512 scale_v = _mm512_set1_ps(scale);
  for (int64_t block = 0; block < padded; block += 16) {
    const int64_t keys_here = std::min<int64_t>(16, length - block);
    for (int64_t g = 0; g < group; ++g) {
      __m512 qv[DC], dots[16];
      for (int c = 0; c < DC; ++c) qv[c] = _mm512_loadu_ps(q + g * DC * 16 + 16 * c);
      for (int64_t i = 0; i < 16; ++i) {
        if (i >= keys_here) {
          dots[i] = _mm512_setzero_ps();
          continue;
        }
        const uint16_t* key = cache.key(slot, kv, block + i);
        __m512 dot = _mm512_mul_ps(qv[0], load16_bf16(key));
        for (int c = 1; c < DC; ++c) dot = _mm512_fmadd_ps(qv[c], load16_bf16(key + 16 * c), dot);
        dots[i] = dot;
      }
      _mm512_storeu_ps(scores.data() + g * padded + block, _mm512_mul_ps(sum_lanes16(dots), scale_v));
    }
  }
  float inverse_sum[64];
  for (int64_t g = 0; g < group; ++g) inverse_sum[g] = softmax_numerators16(scores.data() + g * padded, length);
  constexpr int H = DC >= 16 ? 1 : DC >= 8 ? 2 : DC >= 4 ? 6 : 8;  // H * DC accumulators in 32 registers
  weigh_values16_heads<DC, H>(scores.data(), padded, inverse_sum, out, group, slot, kv, length, cache);
}

// ---- amx and avx512bf16: S = Q K^T and O = P V as tile products ------------------------------------------------

// One task's operands in tile layouts, rebuilt per task (a request's keys are read once for all its rows).
// Each thread keeps its own between passes: allocated afresh, a long cache's packed keys and values faulted in
// their pages on every pass (a decoding row's attention at 2000 positions 20% slower than the fp32 loop). It
// keeps the size of the longest task its thread has met: about 4 x head_dim bytes a position (16 MiB a thread
// at 32k positions and head_dim 128).
struct TileScratch {
  AlignedVector<uint32_t> keys;    // K^T: [16-key block][head_dim / 32][16 dim pairs][16 keys], bf16 pairs
  AlignedVector<uint16_t> values;  // V: [32-key block][head_dim / 16][16 key pairs][16 dims][2 keys]
  AlignedVector<uint16_t> queries; // [16][head_dim] bf16
  std::vector<float> scores;       // [16][padded keys]
  AlignedVector<uint16_t> weights; // softmax numerators, bf16 [16][padded keys]
};

// At least n elements; a scratch buffer never shrinks (whatever it held stays: callers write what they read).
template <typename V>
static void grow(V& v, size_t n) {
  if (v.size() < n) v.resize(n);
}

// r[i][j] -> r[j][i] for a 16 x 16 block of 32-bit values.
__attribute__((target("avx512f"))) static void transpose16x16(__m512i* r) {
  __m512i t[16], u[16];
  for (int i = 0; i < 16; i += 2) {  // per 128-bit lane: pairs of rows interleaved
    t[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]);
    t[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]);
  }
  for (int i = 0; i < 16; i += 4) {  // u[i + c], lane L: rows i..i+3 at column 4L + c
    u[i] = _mm512_unpacklo_epi64(t[i], t[i + 2]);
    u[i + 1] = _mm512_unpackhi_epi64(t[i], t[i + 2]);
    u[i + 2] = _mm512_unpacklo_epi64(t[i + 1], t[i + 3]);
    u[i + 3] = _mm512_unpackhi_epi64(t[i + 1], t[i + 3]);
  }
  for (int c = 0; c < 4; ++c) {  // column 4L + c gathers lane L of u[c], u[4 + c], u[8 + c], u[12 + c]
    const __m512i even_a = _mm512_shuffle_i32x4(u[c], u[4 + c], 0x88), odd_a = _mm512_shuffle_i32x4(u[c], u[4 + c], 0xdd);
    const __m512i even_b = _mm512_shuffle_i32x4(u[8 + c], u[12 + c], 0x88),
                  odd_b = _mm512_shuffle_i32x4(u[8 + c], u[12 + c], 0xdd);
    r[c] = _mm512_shuffle_i32x4(even_a, even_b, 0x88);
    r[8 + c] = _mm512_shuffle_i32x4(even_a, even_b, 0xdd);
    r[4 + c] = _mm512_shuffle_i32x4(odd_a, odd_b, 0x88);
    r[12 + c] = _mm512_shuffle_i32x4(odd_a, odd_b, 0xdd);
  }
}

// Keys and values [first, last) of (slot, kv) towards L2.
static void prefetch_keys_values(const CacheView& cache, int64_t slot, int64_t kv, int64_t first, int64_t last) {
  const int64_t bytes = cache.head_dim * 2;
  for (int64_t key = first; key < last; ++key)
    for (int64_t byte = 0; byte < bytes; byte += 64) {
      _mm_prefetch(reinterpret_cast<const char*>(cache.key(slot, kv, key)) + byte, _MM_HINT_T1);
      _mm_prefetch(reinterpret_cast<const char*>(cache.value(slot, kv, key)) + byte, _MM_HINT_T1);
    }
}

// Keys [0, length) of (slot, kv) into the tile layouts; keys up to `padded` (a multiple of 32) are zeros.
__attribute__((target("avx512f,avx512bw"))) static void pack_keys_values(const CacheView& cache, int64_t slot,
                                                                         int64_t kv, int64_t length,
                                                                         int64_t padded, TileScratch& s) {
  const int64_t D = cache.head_dim, dblocks = D / 16;
  grow(s.keys, padded * D / 2);
  grow(s.values, padded * D);
  // a task reads a few KiB per key block, too little for the hardware prefetchers to ramp up: ask ahead
  constexpr int64_t ahead = 128;
  prefetch_keys_values(cache, slot, kv, 0, std::min(length, ahead));
  for (int64_t block = 0; block < padded; block += 16) {
    prefetch_keys_values(cache, slot, kv, block + ahead, std::min(length, block + ahead + 16));
    uint32_t* tile = s.keys.data() + block * D / 2;
    for (int64_t half = 0; half < D / 32; ++half) {  // 16 keys x 16 dim pairs -> 16 dim pairs x 16 keys
      __m512i rows[16];
      for (int64_t i = 0; i < 16; ++i)
        rows[i] = block + i < length ? _mm512_loadu_si512(cache.key(slot, kv, block + i) + 32 * half)
                                     : _mm512_setzero_si512();
      transpose16x16(rows);
      for (int64_t p = 0; p < 16; ++p) _mm512_storeu_si512(tile + (half * 16 + p) * 16, rows[p]);
    }
  }
  // value rows 2p and 2p + 1 interleaved: one 64-byte row of a B tile holds both keys' values of 16 dims
  const __m512i low = _mm512_set_epi16(47, 15, 46, 14, 45, 13, 44, 12, 43, 11, 42, 10, 41, 9, 40, 8, 39, 7, 38, 6, 37,
                                       5, 36, 4, 35, 3, 34, 2, 33, 1, 32, 0);
  const __m512i high = _mm512_add_epi16(low, _mm512_set1_epi16(16));
  for (int64_t block = 0; block < padded; block += 32)
    for (int64_t pair = 0; pair < 16; ++pair) {
      const int64_t key = block + 2 * pair;
      for (int64_t chunk = 0; chunk < D; chunk += 32) {  // 32 dims of both keys -> rows of dim blocks c, c + 1
        const __m512i a = key < length ? _mm512_loadu_si512(cache.value(slot, kv, key) + chunk) : _mm512_setzero_si512();
        const __m512i b = key + 1 < length ? _mm512_loadu_si512(cache.value(slot, kv, key + 1) + chunk)
                                           : _mm512_setzero_si512();
        uint16_t* out = s.values.data() + (block / 32) * dblocks * 512 + (chunk / 16) * 512 + pair * 32;
        _mm512_storeu_si512(out, _mm512_permutex2var_epi16(a, low, b));
        _mm512_storeu_si512(out + 512, _mm512_permutex2var_epi16(a, high, b));
      }
    }
}

// Scores S = Q K^T of the 16 query vectors in s.queries against the packed keys, into s.scores: tile 0
// accumulates the head width's halves (queries in tiles 1-4, keys in 5 and 6).
__attribute__((target("amx-tile,amx-bf16,avx512f"))) static void scores_amx(int64_t D, int64_t padded,
                                                                            TileScratch& s) {
  const int64_t halves = D / 32;
  grow(s.scores, 16 * padded);
  _tile_loadd(1, s.queries.data(), D * 2);
  if (halves > 1) _tile_loadd(2, s.queries.data() + 32, D * 2);
  if (halves > 2) {
    _tile_loadd(3, s.queries.data() + 64, D * 2);
    _tile_loadd(4, s.queries.data() + 96, D * 2);
  }
  for (int64_t block = 0; block < padded; block += 16) {
    const uint32_t* kt = s.keys.data() + block * D / 2;
    _tile_zero(0);
    _tile_loadd(5, kt, 64);
    _tile_dpbf16ps(0, 1, 5);
    if (halves > 1) {
      _tile_loadd(6, kt + 256, 64);
      _tile_dpbf16ps(0, 2, 6);
    }
    if (halves > 2) {
      _tile_loadd(5, kt + 512, 64);
      _tile_dpbf16ps(0, 3, 5);
      _tile_loadd(6, kt + 768, 64);
      _tile_dpbf16ps(0, 4, 6);
    }
    _tile_stored(0, s.scores.data() + block, padded * 4);
  }
}

// Per vector v < count, over its own keys: scores times `scale`, softmax numerators rounded to bf16 into
// s.weights (zero past its length), and 1 / their fp32 sum into inverse_sum[v]. Two passes over a row: the
// maximum of the scaled scores, then exp, sum and rounding (the scaled scores are recomputed, not stored: the
// same product, so the same bits).
__attribute__((target("avx512f,avx512bf16"))) static void softmax_numerators(const int64_t* lengths, int64_t count,
                                                                           int64_t padded, float scale,
                                                                           TileScratch& s, float* inverse_sum) {
  grow(s.weights, 16 * padded);
  const __m512 scale_v = _mm512_set1_ps(scale);
  for (int64_t v = 0; v < count; ++v) {
    const float* row = s.scores.data() + v * padded;
    uint16_t* weights = s.weights.data() + v * padded;
    const int64_t length = lengths[v], blocks_end = (length + 15) / 16 * 16;
    auto valid = [&](int64_t key) {  // keys past the length read as 0 and weigh 0
      return (__mmask16)(length - key >= 16 ? 0xffff : (1u << (length - key)) - 1);
    };
    __m512 top = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
    for (int64_t key = 0; key < length; key += 16)
      top = _mm512_mask_max_ps(top, valid(key), top, _mm512_mul_ps(_mm512_maskz_loadu_ps(valid(key), row + key), scale_v));
    const v16f top_v = v16_splat(_mm512_reduce_max_ps(top));
    __m512 total = _mm512_setzero_ps();
    for (int64_t key = 0; key < length; key += 16) {
      const __m512 scaled = _mm512_mul_ps(_mm512_maskz_loadu_ps(valid(key), row + key), scale_v);
      v16f x;
      std::memcpy(&x, &scaled, sizeof(x));
      const v16f e = vec_exp(x - top_v);
      __m512 weight;
      std::memcpy(&weight, &e, sizeof(e));
      weight = _mm512_maskz_mov_ps(valid(key), weight);
      total = _mm512_add_ps(total, weight);
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(weights + key), (__m256i)_mm512_cvtneps_pbh(weight));
    }
    v16f t;
    std::memcpy(&t, &total, sizeof(t));
    inverse_sum[v] = 1.0f / v16_sum(t);
    std::memset(weights + blocks_end, 0, (padded - blocks_end) * 2);
  }
}

// Outputs O = P V: tiles 0-3 accumulate four 16-dim blocks at a time (weights in tile 4, values in 5 and 6),
// then each vector's row is scaled by its inverse sum into out[v].
__attribute__((target("amx-tile,amx-bf16,avx512f"))) static void weigh_values_amx(float* const* out, int64_t count,
                                                                                  int64_t D, int64_t padded,
                                                                                  const float* inverse_sum,
                                                                                  const TileScratch& s) {
  const int64_t dblocks = D / 16;
  alignas(64) float result[4][256];
  for (int64_t d0 = 0; d0 < dblocks; d0 += 4) {
    const int64_t nd = std::min<int64_t>(4, dblocks - d0);
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    for (int64_t block = 0; block < padded; block += 32) {
      const uint16_t* vt = s.values.data() + (block / 32) * dblocks * 512 + d0 * 512;
      _tile_loadd(4, s.weights.data() + block, padded * 2);
      _tile_loadd(5, vt, 64);
      _tile_dpbf16ps(0, 4, 5);
      if (nd > 1) {
        _tile_loadd(6, vt + 512, 64);
        _tile_dpbf16ps(1, 4, 6);
      }
      if (nd > 2) {
        _tile_loadd(5, vt + 1024, 64);
        _tile_dpbf16ps(2, 4, 5);
      }
      if (nd > 3) {
        _tile_loadd(6, vt + 1536, 64);
        _tile_dpbf16ps(3, 4, 6);
      }
    }
    _tile_stored(0, result[0], 64);
    _tile_stored(1, result[1], 64);
    _tile_stored(2, result[2], 64);
    _tile_stored(3, result[3], 64);
    for (int64_t v = 0; v < count; ++v)
      for (int64_t b = 0; b < nd; ++b)
        _mm512_storeu_ps(out[v] + (d0 + b) * 16,
                         _mm512_mul_ps(_mm512_loadu_ps(result[b] + v * 16), _mm512_set1_ps(inverse_sum[v])));
  }
}

// Up to 16 query vectors (query q[v], length lengths[v]) rounded to bf16 into s.queries. Rows past `count`
// keep whatever they held: a tile row only meets its own row of the products.
__attribute__((target("avx512f,avx512bf16"))) static void round_queries(const float* const* q, int64_t count,
                                                                       int64_t D, TileScratch& s) {
  grow(s.queries, 16 * D);
  for (int64_t v = 0; v < count; ++v)
    for (int64_t d = 0; d < D; d += 16)
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(&s.queries[v * D + d]),
                          (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(q[v] + d)));
}

// Up to 16 query vectors (vector v: query q[v], length lengths[v]) over the packed keys and values.
static void attend_tile_amx(const float* const* q, float* const* out, const int64_t* lengths, int64_t count,
                            int64_t D, int64_t padded, float scale, TileScratch& s) {
  round_queries(q, count, D, s);
  scores_amx(D, padded, s);
  float inverse_sum[16];
  softmax_numerators(lengths, count, padded, scale, s, inverse_sum);
  weigh_values_amx(out, count, D, padded, inverse_sum, s);
}

// avx512bf16: R query vectors x NB 16-key blocks of scores, one accumulator each. Per dim pair: NB rows of the
// packed K^T and R broadcast query pairs (the 6 x 4 shape of the bf16 linear's tile).
template <int R, int NB>
__attribute__((target("avx512f,avx512bf16"))) static void scores_tile_bf16(const uint16_t* queries, int64_t D,
                                                                          const uint32_t* keys, float* scores,
                                                                          int64_t padded) {
  __m512 acc[R][NB];
  for (int r = 0; r < R; ++r)
    for (int b = 0; b < NB; ++b) acc[r][b] = _mm512_setzero_ps();
  for (int64_t p = 0; p < D / 2; ++p) {
    __m512bh k[NB];
    for (int b = 0; b < NB; ++b) k[b] = (__m512bh)_mm512_loadu_si512(keys + b * 8 * D + p * 16);
    for (int r = 0; r < R; ++r) {
      uint32_t pair;
      std::memcpy(&pair, queries + r * D + 2 * p, 4);
      const __m512bh qp = (__m512bh)_mm512_set1_epi32(int32_t(pair));
      for (int b = 0; b < NB; ++b) acc[r][b] = _mm512_dpbf16_ps(acc[r][b], qp, k[b]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int b = 0; b < NB; ++b) _mm512_storeu_ps(scores + r * padded + 16 * b, acc[r][b]);
}

// avx512bf16: R vectors' weighted values in NDB 16-dim blocks from d0, over key pairs [0, pairs) in order, each
// scaled by its vector's inverse sum into out[v]. Per key pair: NDB rows of the packed V, R broadcast weight pairs.
template <int R, int NDB>
__attribute__((target("avx512f,avx512bf16"))) static void weigh_tile_bf16(const uint16_t* weights, int64_t padded,
                                                                         int64_t pairs, const uint16_t* values,
                                                                         int64_t dblocks, int64_t d0,
                                                                         const float* inverse_sum,
                                                                         float* const* out) {
  __m512 acc[R][NDB];
  for (int r = 0; r < R; ++r)
    for (int b = 0; b < NDB; ++b) acc[r][b] = _mm512_setzero_ps();
  for (int64_t first = 0; first < pairs; first += 16) {  // the key pairs of one 32-key block
    const uint16_t* block = values + (first / 16) * dblocks * 512 + d0 * 512;
    for (int64_t jp = first; jp < std::min(pairs, first + 16); ++jp) {
      __m512bh v[NDB];
      for (int b = 0; b < NDB; ++b) v[b] = (__m512bh)_mm512_loadu_si512(block + b * 512 + (jp - first) * 32);
      for (int r = 0; r < R; ++r) {
        uint32_t pair;
        std::memcpy(&pair, weights + r * padded + 2 * jp, 4);
        const __m512bh wp = (__m512bh)_mm512_set1_epi32(int32_t(pair));
        for (int b = 0; b < NDB; ++b) acc[r][b] = _mm512_dpbf16_ps(acc[r][b], wp, v[b]);
      }
    }
  }
  for (int r = 0; r < R; ++r)
    for (int b = 0; b < NDB; ++b)
      _mm512_storeu_ps(out[r] + (d0 + b) * 16, _mm512_mul_ps(acc[r][b], _mm512_set1_ps(inverse_sum[r])));
}

// Up to 16 query vectors over the packed keys and values by vdpbf16ps. Only the keys up to the vectors' own
// longest length (in 32-key blocks) are computed: a prompt chunk's early rows skip the later rows' keys, and
// the skipped products would weigh exactly 0.
static void attend_tile_bf16(const float* const* q, float* const* out, const int64_t* lengths, int64_t count,
                             int64_t D, int64_t padded, float scale, TileScratch& s) {
  round_queries(q, count, D, s);
  const int64_t longest = *std::max_element(lengths, lengths + count), keys = (longest + 31) / 32 * 32;
  grow(s.scores, 16 * padded);
  run_rows<6>(count, [&](int64_t v, auto rows) {  // vectors in tiles of 6, the rest in one smaller tile
    constexpr int R = decltype(rows)::value;
    const uint16_t* queries = s.queries.data() + v * D;
    float* scores = s.scores.data() + v * padded;
    int64_t block = 0;
    for (; block + 64 <= keys; block += 64)
      scores_tile_bf16<R, 4>(queries, D, s.keys.data() + block * D / 2, scores + block, padded);
    if (block < keys) scores_tile_bf16<R, 2>(queries, D, s.keys.data() + block * D / 2, scores + block, padded);
  });
  float inverse_sum[16];
  softmax_numerators(lengths, count, padded, scale, s, inverse_sum);
  const int64_t dblocks = D / 16;
  run_rows<6>(count, [&](int64_t v, auto rows) {
    constexpr int R = decltype(rows)::value;
    const uint16_t* weights = s.weights.data() + v * padded;
    for (int64_t d0 = 0; d0 < dblocks; d0 += 4) {
      if (dblocks - d0 >= 4)
        weigh_tile_bf16<R, 4>(weights, padded, keys / 2, s.values.data(), dblocks, d0, inverse_sum + v, out + v);
      else
        weigh_tile_bf16<R, 2>(weights, padded, keys / 2, s.values.data(), dblocks, d0, inverse_sum + v, out + v);
    }
  });
}

// One task on amx or avx512bf16: its rows' query vectors (row-major over (row, head of the group)) in tiles of 16.
static void attend_task_tiles(bool amx, const float* q, int64_t q_stride, float* out, int64_t width, int64_t first,
                              int64_t last, int64_t kv, int64_t group, const int64_t* slots, const int64_t* positions,
                              const CacheView& cache, float scale, TileScratch& s) {
  const int64_t D = cache.head_dim;
  int64_t longest = 0;
  for (int64_t r = first; r < last; ++r) longest = std::max(longest, positions[r] + 1);
  const int64_t padded = (longest + 31) / 32 * 32;
  pack_keys_values(cache, slots[first], kv, longest, padded, s);
  const float* queries[16];
  float* outputs[16];
  int64_t lengths[16], count = 0;
  auto flush = [&] {
    if (count) (amx ? attend_tile_amx : attend_tile_bf16)(queries, outputs, lengths, count, D, padded, scale, s);
    count = 0;
  };
  for (int64_t r = first; r < last; ++r)
    for (int64_t g = 0; g < group; ++g) {
      const int64_t head = kv * group + g;
      queries[count] = q + r * q_stride + head * D;
      outputs[count] = out + r * width + head * D;
      lengths[count++] = positions[r] + 1;
      if (count == 16) flush();
    }
  flush();
}

// ---- avx2: (row, head) pairs in the lanes, no horizontal sums -----------------------------------------------
// A task's query vectors (its rows x the heads sharing kv head `kv`) are transposed so that the 8 lanes of a
// register hold 8 (row, head) pairs. A score is then one lane's chain of FMAs over the head's width, in order
// d = 0, 1, ..., and a weighted value one lane's chain over the keys, in key order: each pair keeps its own
// lane from the first multiply to the last, so which pairs share a register, and whether a row runs alone,
// never changes its bits. A key or value element is broadcast to all lanes from a block widened to fp32 once
// for every pair of the group (the transposed queries stay in L1).

constexpr int64_t kAvx2Pairs = 48;  // (row, head) pairs a group holds: 6 registers of 8 lanes
constexpr int64_t kMaxPairs = 64;   // a group's most pairs: kAvx2Pairs, or one row's heads (use_avx2: group <= 64)
constexpr int64_t kValueBlock = 32;  // values widened at a time: 8 KB at head_dim 64, beside a tile's weights in L1

struct Avx2Scratch {
  AlignedVector<float> block;    // up to 32 keys (or values) widened to fp32, [key][head_dim] or transposed
  AlignedVector<float> queries;  // [vector][head_dim][8 lanes]
  AlignedVector<float> scores;   // [vector][padded keys][8 lanes]: scaled scores, then softmax numerators
  AlignedVector<float> sums;     // [vector][head_dim][8 lanes]: weighted values, before 1 / sum
};

// 8 bf16 values widened to fp32 (exactly).
__attribute__((target("avx2"), always_inline)) static inline __m256 load8_bf16(const uint16_t* p) {
  const __m256i wide = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return _mm256_castsi256_ps(_mm256_slli_epi32(wide, 16));
}

// 8 consecutive keys (or values) from `first_key` as fp32 rows of `dim`, zeros past the first `count`.
__attribute__((target("avx2"))) static void widen_block(const uint16_t* first_key, int64_t dim, int64_t count,
                                                       float* out) {
  for (int64_t i = 0; i < 8; ++i)
    for (int64_t d = 0; d < dim; d += 8)
      _mm256_store_ps(out + i * dim + d, i < count ? load8_bf16(first_key + i * dim + d) : _mm256_setzero_ps());
}

// Scores of V pair vectors against keys k0 .. k0 + K - 1 of the widened block, times `scale`, into
// scores[vector][b + k][lane]. V x K accumulators: enough independent chains to hide the FMA latency.
template <int V, int K>
__attribute__((target("avx2,fma"), always_inline)) static inline void scores_tile(const float* queries,
                                                                                 const float* keys, int64_t dim,
                                                                                 int64_t padded, int64_t b,
                                                                                 int64_t k0, float scale,
                                                                                 float* scores) {
  __m256 acc[V][K], qv[V];
  for (int v = 0; v < V; ++v) qv[v] = _mm256_load_ps(queries + v * dim * 8);
  for (int k = 0; k < K; ++k) {
    const __m256 key = _mm256_broadcast_ss(keys + (k0 + k) * dim);
    for (int v = 0; v < V; ++v) acc[v][k] = _mm256_mul_ps(qv[v], key);
  }
  for (int64_t d = 1; d < dim; ++d) {
    for (int v = 0; v < V; ++v) qv[v] = _mm256_load_ps(queries + (v * dim + d) * 8);
    for (int k = 0; k < K; ++k) {
      const __m256 key = _mm256_broadcast_ss(keys + (k0 + k) * dim + d);
      for (int v = 0; v < V; ++v) acc[v][k] = _mm256_fmadd_ps(qv[v], key, acc[v][k]);
    }
  }
  const __m256 scale_v = _mm256_set1_ps(scale);
  for (int v = 0; v < V; ++v)
    for (int k = 0; k < K; ++k)
      _mm256_store_ps(scores + (v * padded + b + k0 + k) * 8, _mm256_mul_ps(acc[v][k], scale_v));
}

// sums[vector][d0 .. d0 + C][lane] += weights[vector][b + j][lane] * values[j][d] over the block's `keys` keys, in
// key order, for V pair vectors.
template <int V, int C>
__attribute__((target("avx2,fma"), always_inline)) static inline void weigh_tile(const float* weights,
                                                                                const float* values, int64_t dim,
                                                                                int64_t padded, int64_t b,
                                                                                int64_t keys, int64_t d0,
                                                                                float* sums) {
  __m256 acc[V][C];
  for (int v = 0; v < V; ++v)
    for (int c = 0; c < C; ++c) acc[v][c] = _mm256_load_ps(sums + (v * dim + d0 + c) * 8);
  for (int64_t j = 0; j < keys; ++j) {
    __m256 w[V];
    for (int v = 0; v < V; ++v) w[v] = _mm256_load_ps(weights + (v * padded + b + j) * 8);
    for (int c = 0; c < C; ++c) {
      const __m256 value = _mm256_broadcast_ss(values + j * dim + d0 + c);
      for (int v = 0; v < V; ++v) acc[v][c] = _mm256_fmadd_ps(w[v], value, acc[v][c]);
    }
  }
  for (int v = 0; v < V; ++v)
    for (int c = 0; c < C; ++c) _mm256_store_ps(sums + (v * dim + d0 + c) * 8, acc[v][c]);
}

// Every pair vector's scores against the widened block at key b, up to 3 vectors a tile.
__attribute__((target("avx2,fma"))) static void scores_block(const float* queries, const float* keys, int64_t vectors,
                                                            int64_t dim, int64_t padded, int64_t b, float scale,
                                                            float* scores) {
  for (int64_t v = 0; v < vectors; v += 3) {
    const float* q = queries + v * dim * 8;
    float* out = scores + v * padded * 8;
    switch (std::min<int64_t>(3, vectors - v)) {
      case 1: scores_tile<1, 8>(q, keys, dim, padded, b, 0, scale, out); break;
      case 2:
        scores_tile<2, 4>(q, keys, dim, padded, b, 0, scale, out);
        scores_tile<2, 4>(q, keys, dim, padded, b, 4, scale, out);
        break;
      default:
        scores_tile<3, 4>(q, keys, dim, padded, b, 0, scale, out);
        scores_tile<3, 4>(q, keys, dim, padded, b, 4, scale, out);
        break;
    }
  }
}

// Every pair vector's weighted values over the widened block of `keys` keys at key b, up to 3 vectors a tile.
__attribute__((target("avx2,fma"))) static void weigh_block(const float* weights, const float* values,
                                                           int64_t vectors, int64_t dim, int64_t padded, int64_t b,
                                                           int64_t keys, float* sums) {
  for (int64_t v = 0; v < vectors; v += 3) {
    const float* w = weights + v * padded * 8;
    float* out = sums + v * dim * 8;
    const int64_t left = std::min<int64_t>(3, vectors - v);
    for (int64_t d0 = 0; d0 < dim; d0 += left == 1 ? 8 : 4) {
      switch (left) {
        case 1: weigh_tile<1, 8>(w, values, dim, padded, b, keys, d0, out); break;
        case 2: weigh_tile<2, 4>(w, values, dim, padded, b, keys, d0, out); break;
        default: weigh_tile<3, 4>(w, values, dim, padded, b, keys, d0, out); break;
      }
    }
  }
}

// Softmax numerators of one pair vector's scores ([padded keys][8 lanes]), in place: exp(x - max) over each
// lane's first lengths[lane] keys and exactly 0 past them; returns 1 / each lane's sum. The sum is the one
// softmax_numerators8 makes with keys in the lanes: 8 partial sums (key j into partial j % 8, in key order),
// then v8_sum's tree, so that both layouts give a pair the same bits.
__attribute__((target("avx2,fma"))) static __m256 softmax_lanes(float* s, int64_t padded, __m256i lengths) {
  const __m256 minus_inf = _mm256_set1_ps(-std::numeric_limits<float>::infinity());
  __m256 top = minus_inf;
  for (int64_t j = 0; j < padded; ++j) {
    const __m256 valid = _mm256_castsi256_ps(_mm256_cmpgt_epi32(lengths, _mm256_set1_epi32(int(j))));
    top = _mm256_max_ps(top, _mm256_blendv_ps(minus_inf, _mm256_load_ps(s + 8 * j), valid));
  }
  v8f top_v;
  std::memcpy(&top_v, &top, sizeof(top));
  __m256 partial[8];
  for (int m = 0; m < 8; ++m) partial[m] = _mm256_setzero_ps();
  for (int64_t j0 = 0; j0 < padded; j0 += 8)
    for (int m = 0; m < 8; ++m) {
      const int64_t j = j0 + m;
      const __m256 valid = _mm256_castsi256_ps(_mm256_cmpgt_epi32(lengths, _mm256_set1_epi32(int(j))));
      const v8f e = vec_exp(v8_load(s + 8 * j) - top_v);
      __m256 weight;
      std::memcpy(&weight, &e, sizeof(e));
      weight = _mm256_and_ps(weight, valid);
      _mm256_store_ps(s + 8 * j, weight);
      partial[m] = _mm256_add_ps(partial[m], weight);
    }
  const __m256 total = _mm256_add_ps(
      _mm256_add_ps(_mm256_add_ps(partial[0], partial[4]), _mm256_add_ps(partial[2], partial[6])),
      _mm256_add_ps(_mm256_add_ps(partial[1], partial[5]), _mm256_add_ps(partial[3], partial[7])));
  return _mm256_div_ps(_mm256_set1_ps(1.0f), total);
}

// Softmax numerators of one row of scores, in place: exp(x - max) over its first `length` entries and 0 in the
// rest of the last 8; returns 1 / their sum. The max is taken 8 lanes at a time (a max is exact in any order; a
// scalar loop's compare chain took as long as the scores' arithmetic).
SPECSTAND_INLINE float softmax_numerators8(float* s, int64_t length) {
  v8f lanes = v8_splat(-std::numeric_limits<float>::infinity());
  int64_t j = 0;
  for (; j + 8 <= length; j += 8) {
    const v8f x = v8_load(s + j);
    lanes = x > lanes ? x : lanes;
  }
  float top = lanes[0];
  for (int i = 1; i < 8; ++i) top = lanes[i] > top ? lanes[i] : top;
  for (; j < length; ++j) top = s[j] > top ? s[j] : top;
  const int64_t padded = (length + 7) / 8 * 8;
  v8f total = v8_splat(0.0f);
  for (int64_t j = 0; j < padded; j += 8) {
    v8f e = vec_exp(v8_load(s + j) - v8_splat(top));
    if (j + 8 > length) {  // lanes past the row's last key weigh exactly 0
      for (int64_t lane = length - j; lane < 8; ++lane) e[lane] = 0.0f;
    }
    v8_store(s + j, e);
    total = total + e;
  }
  return 1.0f / v8_sum(total);
}

// ---- avx2, few pairs (a decoding row): keys in the lanes, the same arithmetic ---------------------------------
// With fewer pairs than lanes the layout above would leave most lanes idle. Keys take the lanes instead, from
// blocks of 8 keys widened and transposed to [dim][8 keys]; every score, partial sum and weighted value is the
// same operation on the same operands in the same order as above, so a pair gets the same bits either way.

constexpr int64_t kFewPairs = 6;        // at most this many pairs: keys in the lanes
constexpr int64_t kFewPairsKeys = 32;  // keys a score tile covers: 4 lanes-wide blocks

// 8 consecutive keys from `first_key` widened to fp32 and transposed to out[d][key], zeros past the first `count`.
// Transposed as 32-bit units (two bf16 dims each) and widened after: a unit shifted left by 16 is its even dim's
// fp32, the unit with its low half cleared its odd dim's.
__attribute__((target("avx2"))) static void widen_transposed(const uint16_t* first_key, int64_t dim, int64_t count,
                                                            float* out) {
  const __m256i high_half = _mm256_set1_epi32(int32_t(0xffff0000u));
  auto dims8 = [&](int64_t i, int64_t d0) {
    return i < count ? _mm_loadu_si128(reinterpret_cast<const __m128i*>(first_key + i * dim + d0)) : _mm_setzero_si128();
  };
  for (int64_t d0 = 0; d0 < dim; d0 += 8) {
    __m256i x[4];  // keys i (low 128 bits) and i + 4 (high), dims d0 .. d0 + 8 as 4 units
    for (int64_t i = 0; i < 4; ++i) x[i] = _mm256_set_m128i(dims8(i + 4, d0), dims8(i, d0));
    const __m256i t0 = _mm256_unpacklo_epi32(x[0], x[1]), t1 = _mm256_unpackhi_epi32(x[0], x[1]);
    const __m256i t2 = _mm256_unpacklo_epi32(x[2], x[3]), t3 = _mm256_unpackhi_epi32(x[2], x[3]);
    const __m256i units[4] = {_mm256_unpacklo_epi64(t0, t2), _mm256_unpackhi_epi64(t0, t2),
                              _mm256_unpacklo_epi64(t1, t3), _mm256_unpackhi_epi64(t1, t3)};
    for (int u = 0; u < 4; ++u) {  // unit u: dims d0 + 2u (low 16 bits) and d0 + 2u + 1 (high) of keys 0 .. 7
      _mm256_store_ps(out + (d0 + 2 * u) * 8, _mm256_castsi256_ps(_mm256_slli_epi32(units[u], 16)));
      _mm256_store_ps(out + (d0 + 2 * u + 1) * 8, _mm256_castsi256_ps(_mm256_and_si256(units[u], high_half)));
    }
  }
}

// Scores of P pairs (queries q[p]) against the 32 transposed keys in `keys` ([block][dim][8]), times `scale`,
// into scores[p][0 .. 32): one lane's chain over d per (pair, key), as scores_tile makes it.
template <int P>
__attribute__((target("avx2,fma"), always_inline)) static inline void scores_keys_tile(const float* const* q,
                                                                                      const float* keys,
                                                                                      int64_t dim, float scale,
                                                                                      float* const* scores) {
  __m256 acc[P][4];
  for (int p = 0; p < P; ++p) {
    const __m256 qd = _mm256_broadcast_ss(q[p]);
    for (int k = 0; k < 4; ++k) acc[p][k] = _mm256_mul_ps(qd, _mm256_load_ps(keys + k * dim * 8));
  }
  for (int64_t d = 1; d < dim; ++d)
    for (int p = 0; p < P; ++p) {
      const __m256 qd = _mm256_broadcast_ss(q[p] + d);
      for (int k = 0; k < 4; ++k) acc[p][k] = _mm256_fmadd_ps(qd, _mm256_load_ps(keys + (k * dim + d) * 8), acc[p][k]);
    }
  const __m256 scale_v = _mm256_set1_ps(scale);
  for (int p = 0; p < P; ++p)
    for (int k = 0; k < 4; ++k) _mm256_storeu_ps(scores[p] + 8 * k, _mm256_mul_ps(acc[p][k], scale_v));
}

// With keys in the lanes: sums[p][d0 .. d0 + 8 C) = sum over keys j < keys, in key order, of weights[p][j] *
// values[j][d0 ..] for P pairs. Each value vector is widened from the bf16 cache in a register (exactly) and
// serves all P pairs; a pair's weights past its own length are 0, so it adds exact zeros there, as the pairs in
// the lanes do. The same chain of FMAs per (pair, dim) as weigh_tile: the same bits.
template <int P, int C>
__attribute__((target("avx2,fma"), always_inline)) static inline void weigh_values_tile(const float* const* weights,
                                                                                       const uint16_t* values,
                                                                                       int64_t dim, int64_t keys,
                                                                                       int64_t d0, float* const* sums) {
  __m256 acc[P][C];
  for (int p = 0; p < P; ++p)
    for (int c = 0; c < C; ++c) acc[p][c] = _mm256_setzero_ps();
  for (int64_t j = 0; j < keys; ++j) {
    __m256 w[P];
    for (int p = 0; p < P; ++p) w[p] = _mm256_broadcast_ss(weights[p] + j);
    for (int c = 0; c < C; ++c) {
      const __m256 value = load8_bf16(values + j * dim + d0 + 8 * c);
      for (int p = 0; p < P; ++p) acc[p][c] = _mm256_fmadd_ps(w[p], value, acc[p][c]);
    }
  }
  for (int p = 0; p < P; ++p)
    for (int c = 0; c < C; ++c) _mm256_store_ps(sums[p] + d0 + 8 * c, acc[p][c]);
}

// weigh_values_tile for P pairs over every 32-dim range of the head (the last one narrower where dim needs).
template <int P>
__attribute__((target("avx2,fma"), always_inline)) static inline void weigh_values_pairs(const float* const* weights,
                                                                                        const uint16_t* values,
                                                                                        int64_t dim, int64_t keys,
                                                                                        float* const* sums) {
  for (int64_t d0 = 0; d0 < dim; d0 += 32) {
    switch (std::min<int64_t>(4, (dim - d0) / 8)) {
      case 1: weigh_values_tile<P, 1>(weights, values, dim, keys, d0, sums); break;
      case 2: weigh_values_tile<P, 2>(weights, values, dim, keys, d0, sums); break;
      case 3: weigh_values_tile<P, 3>(weights, values, dim, keys, d0, sums); break;
      default: weigh_values_tile<P, 4>(weights, values, dim, keys, d0, sums); break;
    }
  }
}

// Rows [r0, r0 + rows) of one request (the longest `longest` positions) against kv head `kv` with keys in the
// lanes (at most kFewPairs pairs).
__attribute__((target("avx2,fma"))) static void attend_few_pairs(const float* q, int64_t q_stride, float* out,
                                                                 int64_t width, int64_t r0, int64_t rows,
                                                                 int64_t longest, int64_t kv, int64_t group,
                                                                 int64_t slot, const int64_t* positions,
                                                                 const CacheView& cache, float scale, Avx2Scratch& s) {
  const int64_t dim = cache.head_dim, head0 = kv * group * dim, pairs = rows * group;
  const int64_t padded = (longest + kFewPairsKeys - 1) / kFewPairsKeys * kFewPairsKeys;
  const float* queries[kFewPairs];
  for (int64_t p = 0; p < pairs; ++p) queries[p] = q + (r0 + p / group) * q_stride + head0 + (p % group) * dim;
  s.scores.resize(pairs * padded);
  for (int64_t b = 0; b < padded; b += kFewPairsKeys) {
    for (int64_t k = 0; k < kFewPairsKeys; k += 8)
      widen_transposed(cache.key(slot, kv, std::min(b + k, longest - 1)), dim,
                       std::clamp<int64_t>(longest - b - k, 0, 8), s.block.data() + k * dim);
    for (int64_t p0 = 0; p0 < pairs; p0 += 3) {
      float* scores[3];
      for (int64_t p = p0; p < std::min(pairs, p0 + 3); ++p) scores[p - p0] = s.scores.data() + p * padded + b;
      switch (std::min<int64_t>(3, pairs - p0)) {
        case 1: scores_keys_tile<1>(queries + p0, s.block.data(), dim, scale, scores); break;
        case 2: scores_keys_tile<2>(queries + p0, s.block.data(), dim, scale, scores); break;
        default: scores_keys_tile<3>(queries + p0, s.block.data(), dim, scale, scores); break;
      }
    }
  }
  float inverse_sum[kFewPairs];
  for (int64_t p = 0; p < pairs; ++p) {
    const int64_t length = positions[r0 + p / group] + 1;
    float* weights = s.scores.data() + p * padded;
    inverse_sum[p] = softmax_numerators8(weights, length);
    // a longer row's keys weigh exactly 0 for this pair (the last 8 past its length are zeros already)
    std::fill(weights + std::min((length + 7) / 8 * 8, longest), weights + longest, 0.0f);
  }
  s.sums.resize(pairs * dim);
  const uint16_t* values = cache.value(slot, kv, 0);
  for (int64_t p0 = 0; p0 < pairs; p0 += 3) {
    const float* weights[3];
    float* sums[3];
    for (int64_t p = p0; p < std::min(pairs, p0 + 3); ++p) {
      weights[p - p0] = s.scores.data() + p * padded;
      sums[p - p0] = s.sums.data() + p * dim;
    }
    switch (std::min<int64_t>(3, pairs - p0)) {
      case 1: weigh_values_pairs<1>(weights, values, dim, longest, sums); break;
      case 2: weigh_values_pairs<2>(weights, values, dim, longest, sums); break;
      default: weigh_values_pairs<3>(weights, values, dim, longest, sums); break;
    }
  }
  for (int64_t p = 0; p < pairs; ++p) {
    const __m256 inv = _mm256_set1_ps(inverse_sum[p]);
    float* o = out + (r0 + p / group) * width + head0 + (p % group) * dim;
    for (int64_t d = 0; d < dim; d += 8)
      _mm256_storeu_ps(o + d, _mm256_mul_ps(_mm256_load_ps(s.sums.data() + p * dim + d), inv));
  }
}

// Rows [first, last) of one request (increasing positions) against kv head `kv`, kAvx2Pairs pairs a group.
__attribute__((target("avx2,fma"))) static void attend_rows_avx2(const float* q, int64_t q_stride, float* out,
                                                                 int64_t width, int64_t first, int64_t last,
                                                                 int64_t kv, int64_t group, int64_t slot,
                                                                 const int64_t* positions, const CacheView& cache,
                                                                 float scale, Avx2Scratch& s) {
  const int64_t dim = cache.head_dim, head0 = kv * group * dim;
  const int64_t rows_per_group = std::max<int64_t>(1, kAvx2Pairs / group);
  s.block.resize(std::max(kFewPairsKeys, kValueBlock) * dim);  // the widest block either layout widens
  for (int64_t r0 = first; r0 < last; r0 += rows_per_group) {
    const int64_t rows = std::min(rows_per_group, last - r0), pairs = rows * group, vectors = (pairs + 7) / 8;
    int64_t longest = 0;
    for (int64_t r = r0; r < r0 + rows; ++r) longest = std::max(longest, positions[r] + 1);
    if (pairs <= kFewPairs) {
      attend_few_pairs(q, q_stride, out, width, r0, rows, longest, kv, group, slot, positions, cache, scale, s);
      continue;
    }
    const int64_t padded = (longest + 7) / 8 * 8;
    // queries transposed: pair p = (row, head) in lane p % 8 of vector p / 8; spare lanes hold zeros, length 1
    s.queries.assign(vectors * dim * 8, 0.0f);
    alignas(32) int32_t lengths[kMaxPairs];
    std::fill(lengths, lengths + vectors * 8, 1);
    for (int64_t p = 0; p < pairs; ++p) {
      const int64_t r = r0 + p / group, g = p % group;
      const float* qp = q + r * q_stride + head0 + g * dim;
      float* column = s.queries.data() + (p / 8) * dim * 8 + p % 8;
      for (int64_t d = 0; d < dim; ++d) column[d * 8] = qp[d];
      lengths[p] = int32_t(positions[r] + 1);
    }
    s.scores.resize(vectors * padded * 8);
    for (int64_t b = 0; b < padded; b += 8) {
      widen_block(cache.key(slot, kv, b), dim, std::min<int64_t>(8, longest - b), s.block.data());
      scores_block(s.queries.data(), s.block.data(), vectors, dim, padded, b, scale, s.scores.data());
    }
    alignas(32) float inverse_sum[kMaxPairs];
    for (int64_t v = 0; v < vectors; ++v)
      _mm256_store_ps(inverse_sum + 8 * v,
                      softmax_lanes(s.scores.data() + v * padded * 8, padded,
                                    _mm256_load_si256(reinterpret_cast<const __m256i*>(lengths + 8 * v))));
    s.sums.assign(vectors * dim * 8, 0.0f);
    for (int64_t b = 0; b < padded; b += kValueBlock) {  // a tile's sums stay in registers over kValueBlock keys
      const int64_t keys = std::min(kValueBlock, padded - b);
      for (int64_t k = 0; k < keys; k += 8)
        widen_block(cache.value(slot, kv, std::min(b + k, longest - 1)), dim,
                    std::clamp<int64_t>(longest - b - k, 0, 8), s.block.data() + k * dim);
      weigh_block(s.scores.data(), s.block.data(), vectors, dim, padded, b, keys, s.sums.data());
    }
    for (int64_t p = 0; p < pairs; ++p) {
      const int64_t r = r0 + p / group, g = p % group;
      const float* column = s.sums.data() + (p / 8) * dim * 8 + p % 8;
      float* o = out + r * width + head0 + g * dim;
      for (int64_t d = 0; d < dim; ++d) o[d] = column[d * 8] * inverse_sum[p];
    }
  }
}

// ---- portable: 8-lane vectors, one key at a time ----------------------------------------------------------

__attribute__((target_clones("avx2", "default"), flatten)) static void attend_group8(
    const float* q, float* out, int64_t group, int64_t slot, int64_t kv, int64_t length, const CacheView& cache,
    float scale, std::vector<float>& scores) {
  const int64_t dim = cache.head_dim, padded = (length + 7) / 8 * 8;
  scores.assign(group * padded, 0.0f);
  for (int64_t j = 0; j < length; ++j) {
    const uint16_t* key = cache.key(slot, kv, j);
    for (int64_t g = 0; g < group; ++g) {
      v8f dot = v8_splat(0.0f);
      for (int64_t d = 0; d < dim; d += 8) dot = dot + v8_load(q + g * dim + d) * v8_load_bf16(key + d);
      scores[g * padded + j] = v8_sum(dot) * scale;
    }
  }
  std::vector<float> inverse_sum(group);
  for (int64_t g = 0; g < group; ++g) inverse_sum[g] = softmax_numerators8(scores.data() + g * padded, length);
  for (int64_t g = 0; g < group; ++g)
    for (int64_t d = 0; d < dim; d += 8) {  // one 8-wide accumulator in a register over all keys
      v8f sum = v8_splat(0.0f);
      for (int64_t j = 0; j < length; ++j)
        sum = sum + v8_splat(scores[g * padded + j]) * v8_load_bf16(cache.value(slot, kv, j) + d);
      v8_store(out + g * dim + d, sum * v8_splat(inverse_sum[g]));
    }
}

static bool use_tiles(Isa isa, int64_t head_dim) {  // the softmax side rounds with vcvtneps2bf16 (AVX512-BF16)
  static const bool bf16 = cpu_has(Isa::avx512bf16);
  return (isa == Isa::amx || isa == Isa::avx512bf16) && bf16 && (head_dim == 32 || head_dim == 64 || head_dim == 128);
}

static bool use_avx512(Isa isa, int64_t head_dim, int64_t group) {
  const bool dims = head_dim == 16 || head_dim == 32 || head_dim == 64 || head_dim == 128 || head_dim == 256;
  return (isa == Isa::avx512bf16 || isa == Isa::amx) && dims && group <= 64;
}

static bool use_avx2(Isa isa, int64_t head_dim, int64_t group) {
  static const bool avx2 = cpu_has(Isa::avx2);
  return isa != Isa::scalar && avx2 && head_dim % 8 == 0 && group <= 64;
}

// One task: rows [first, last) of one request (contiguous in the pass, one slot) against kv head `kv`.
// A task's rows read the same keys and values, so after its first row they come from L2, not memory.
struct AttentionTask {
  int64_t first, last, kv;
};

static std::vector<AttentionTask> plan_tasks(int64_t rows, const int64_t* slots, int64_t kv_heads,
                                             int64_t min_rows) {
  std::vector<std::pair<int64_t, int64_t>> runs;  // [first, last) rows of one slot
  for (int64_t r = 0; r < rows; ++r) {
    if (runs.empty() || slots[r] != slots[runs.back().first]) runs.emplace_back(r, r);
    runs.back().second = r + 1;
  }
  // split runs into chunks until there are a few tasks per thread (which rows share a task never changes
  // a row's arithmetic, only where its keys come from)
  const int64_t wanted = 4 * at::get_num_threads(), base = int64_t(runs.size()) * kv_heads;
  const int64_t splits = std::max<int64_t>(1, (wanted + base - 1) / base);
  std::vector<AttentionTask> tasks;
  for (const auto& [first, last] : runs) {
    const int64_t chunk = std::max<int64_t>(min_rows, (last - first + splits - 1) / splits);
    for (int64_t kv = 0; kv < kv_heads; ++kv)
      for (int64_t r = first; r < last; r += chunk) tasks.push_back({r, std::min(last, r + chunk), kv});
  }
  return tasks;
}

// The tasks each thread runs: longest first (a task costs its rows' keys), each to the least loaded thread.
// Equal counts of tasks per thread, as parallel_for deals them, left one thread all of a prompt chunk when
// a request's few verify rows shared the pass (their tasks came first): the chunk's attention ran on one
// core. Which thread runs a task never changes its arithmetic.
static std::vector<std::vector<int64_t>> deal_tasks(const std::vector<AttentionTask>& tasks, const int64_t* positions,
                                                    int64_t threads) {
  std::vector<std::pair<int64_t, int64_t>> by_cost;  // (keys read, task)
  for (int64_t t = 0; t < int64_t(tasks.size()); ++t) {
    int64_t keys = 0;
    for (int64_t r = tasks[t].first; r < tasks[t].last; ++r) keys += positions[r] + 1;
    by_cost.emplace_back(keys, t);
  }
  std::stable_sort(by_cost.begin(), by_cost.end(), [](const auto& a, const auto& b) { return a.first > b.first; });
  std::vector<std::vector<int64_t>> lists(threads);
  std::vector<int64_t> load(threads, 0);
  for (const auto& [keys, t] : by_cost) {
    const int64_t least = std::min_element(load.begin(), load.end()) - load.begin();
    lists[least].push_back(t);
    load[least] += keys;
  }
  return lists;
}

void decode_attention(Isa isa, const float* q, int64_t q_stride, float* out, int64_t rows, int64_t heads,
                      const int64_t* slots, const int64_t* positions, const CacheView& cache, float scale) {
  const int64_t group = heads / cache.kv_heads, dim = cache.head_dim, width = heads * dim;
  const bool tiles = use_tiles(isa, dim), amx = tiles && isa == Isa::amx, wide = use_avx512(isa, dim, group);
  const bool avx2 = !wide && use_avx2(isa, dim, group);
  // tiles pack a task's keys and values once for all its rows: split a request's rows only when there are many
  const std::vector<AttentionTask> tasks = plan_tasks(rows, slots, cache.kv_heads, tiles ? 64 : 1);
  const std::vector<std::vector<int64_t>> lists = deal_tasks(tasks, positions, at::get_num_threads());
  at::parallel_for(0, int64_t(lists.size()), 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores;
    // per OpenMP thread for the life of the process: a 2048-key task packs megabytes, which allocating at every
    // call (hundreds of calls a prompt) would fault in again each time; it keeps its longest task's size
    static thread_local TileScratch scratch;
    Avx2Scratch avx2_scratch;
    if (amx) configure_bf16_tiles();
    for (int64_t w = begin; w < end; ++w)
    for (const int64_t t : lists[w]) {
      const int64_t kv = tasks[t].kv, head0 = kv * group * dim;
      if (tiles) {
        attend_task_tiles(amx, q, q_stride, out, width, tasks[t].first, tasks[t].last, kv, group, slots, positions,
                          cache, scale, scratch);
        continue;
      }
      if (avx2) {
        attend_rows_avx2(q, q_stride, out, width, tasks[t].first, tasks[t].last, kv, group, slots[tasks[t].first],
                         positions, cache, scale, avx2_scratch);
        continue;
      }
      for (int64_t r = tasks[t].first; r < tasks[t].last; ++r) {
        const int64_t length = positions[r] + 1;
        const float* qr = q + r * q_stride + head0;
        float* o = out + r * width + head0;
        if (!wide) {
          attend_group8(qr, o, group, slots[r], kv, length, cache, scale, scores);
          continue;
        }
        switch (dim) {
          case 16: attend_group16<1>(qr, o, group, slots[r], kv, length, cache, scale, scores); break;
          case 32: attend_group16<2>(qr, o, group, slots[r], kv, length, cache, scale, scores); break;
          case 64: attend_group16<4>(qr, o, group, slots[r], kv, length, cache, scale, scores); break;
          case 128: attend_group16<8>(qr, o, group, slots[r], kv, length, cache, scale, scores); break;
          default: attend_group16<16>(qr, o, group, slots[r], kv, length, cache, scale, scores); break;
        }
      }
    }
  });
}

}  // namespace specstand
