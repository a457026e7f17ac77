// Decode/verify attention in fp32 over a bf16 cache (widened exactly on load), two paths side by side:
// AVX-512 (FMA, 16 keys a step) where the linear path is avx512bf16 or amx, and portable 8-lane vectors
// (common.h) elsewhere. Every sum has a fixed order that depends on the row's own cache length only, so a
// row computes the same bits alone or beside other rows. Tasks group a request's rows per kv head, so its
// cache is read from memory about once a pass.
#include "attention.h"

#include <ATen/Parallel.h>
#include <immintrin.h>

#include <limits>
#include <vector>

#include "common.h"

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
  for (int64_t g = 0; g < group; ++g) {
    float* s = scores.data() + g * padded;
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
    inverse_sum[g] = 1.0f / v16_sum(t);
  }
  constexpr int H = DC >= 16 ? 1 : DC >= 8 ? 2 : DC >= 4 ? 6 : 8;  // H * DC accumulators in 32 registers
  weigh_values16_heads<DC, H>(scores.data(), padded, inverse_sum, out, group, slot, kv, length, cache);
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
  for (int64_t g = 0; g < group; ++g) {
    float* s = scores.data() + g * padded;
    float top = -std::numeric_limits<float>::infinity();
    for (int64_t j = 0; j < length; ++j) top = s[j] > top ? s[j] : top;
    v8f total = v8_splat(0.0f);
    for (int64_t j = 0; j < padded; j += 8) {
      v8f e = vec_exp(v8_load(s + j) - v8_splat(top));
      if (j + 8 > length) {  // lanes past the row's last key weigh exactly 0
        for (int64_t lane = length - j; lane < 8; ++lane) e[lane] = 0.0f;
      }
      v8_store(s + j, e);
      total = total + e;
    }
    inverse_sum[g] = 1.0f / v8_sum(total);
  }
  for (int64_t g = 0; g < group; ++g)
    for (int64_t d = 0; d < dim; d += 8) {  // one 8-wide accumulator in a register over all keys
      v8f sum = v8_splat(0.0f);
      for (int64_t j = 0; j < length; ++j)
        sum = sum + v8_splat(scores[g * padded + j]) * v8_load_bf16(cache.value(slot, kv, j) + d);
      v8_store(out + g * dim + d, sum * v8_splat(inverse_sum[g]));
    }
}

static bool use_avx512(Isa isa, int64_t head_dim, int64_t group) {
  const bool dims = head_dim == 16 || head_dim == 32 || head_dim == 64 || head_dim == 128 || head_dim == 256;
  return (isa == Isa::avx512bf16 || isa == Isa::amx) && dims && group <= 64;
}

// One task: rows [first, last) of one request (contiguous in the pass, one slot) against kv head `kv`.
// A task's rows read the same keys and values, so after its first row they come from L2, not memory.
struct AttentionTask {
  int64_t first, last, kv;
};

static std::vector<AttentionTask> plan_tasks(int64_t rows, const int64_t* slots, int64_t kv_heads) {
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
    const int64_t chunk = std::max<int64_t>(1, (last - first + splits - 1) / splits);
    for (int64_t kv = 0; kv < kv_heads; ++kv)
      for (int64_t r = first; r < last; r += chunk) tasks.push_back({r, std::min(last, r + chunk), kv});
  }
  return tasks;
}

void decode_attention(Isa isa, const float* q, int64_t q_stride, float* out, int64_t rows, int64_t heads,
                      const int64_t* slots, const int64_t* positions, const CacheView& cache, float scale) {
  const int64_t group = heads / cache.kv_heads, dim = cache.head_dim, width = heads * dim;
  const bool wide = use_avx512(isa, dim, group);
  const std::vector<AttentionTask> tasks = plan_tasks(rows, slots, cache.kv_heads);
  at::parallel_for(0, int64_t(tasks.size()), 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores;
    for (int64_t t = begin; t < end; ++t) {
      const int64_t kv = tasks[t].kv, head0 = kv * group * dim;
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
