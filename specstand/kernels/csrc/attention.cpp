// Decode/verify attention in fp32 on 8-lane vectors (common.h): every sum has a fixed order that depends
// on the row's own cache length only, so a row computes the same bits alone or beside other rows, and on
// any x86 CPU (lane ops are single IEEE operations; the build disables FMA contraction).
#include "attention.h"

#include <ATen/Parallel.h>

#include <limits>
#include <vector>

#include "common.h"

namespace specstand {

// The heads of one query row that share kv head `kv` (grouped-query attention reads each key once).
__attribute__((target_clones("avx2", "default"), flatten)) static void attend_group(
    const float* q, float* out, int64_t group, int64_t slot, int64_t kv, int64_t length, const CacheView& cache,
    float scale, std::vector<float>& scores, std::vector<float>& acc) {
  const int64_t dim = cache.head_dim, padded = (length + 7) / 8 * 8;
  scores.assign(group * padded, 0.0f);
  for (int64_t j = 0; j < length; ++j) {
    const float* key = cache.key(slot, kv, j);
    for (int64_t g = 0; g < group; ++g) {
      v8f dot = v8_splat(0.0f);
      for (int64_t d = 0; d < dim; d += 8) dot = dot + v8_load(q + g * dim + d) * v8_load(key + d);
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
      v8f e = v8_exp(v8_load(s + j) - v8_splat(top));
      if (j + 8 > length) {  // lanes past the row's last key weigh exactly 0
        for (int64_t lane = length - j; lane < 8; ++lane) e[lane] = 0.0f;
      }
      v8_store(s + j, e);
      total = total + e;
    }
    inverse_sum[g] = 1.0f / v8_sum(total);
  }
  acc.assign(group * dim, 0.0f);
  for (int64_t j = 0; j < length; ++j) {
    const float* value = cache.value(slot, kv, j);
    for (int64_t g = 0; g < group; ++g) {
      const v8f weight = v8_splat(scores[g * padded + j]);
      for (int64_t d = 0; d < dim; d += 8) v8_store(&acc[g * dim + d], v8_load(&acc[g * dim + d]) + weight * v8_load(value + d));
    }
  }
  for (int64_t g = 0; g < group; ++g)
    for (int64_t d = 0; d < dim; d += 8)
      v8_store(out + g * dim + d, v8_load(&acc[g * dim + d]) * v8_splat(inverse_sum[g]));
}

void decode_attention(const float* q, int64_t q_stride, float* out, int64_t rows, int64_t heads,
                      const int64_t* slots, const int64_t* positions, const CacheView& cache, float scale) {
  const int64_t group = heads / cache.kv_heads, dim = cache.head_dim, width = heads * dim;
  at::parallel_for(0, rows * cache.kv_heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores, acc;
    for (int64_t task = begin; task < end; ++task) {
      const int64_t r = task / cache.kv_heads, kv = task % cache.kv_heads;
      const int64_t head0 = kv * group * dim;
      attend_group(q + r * q_stride + head0, out + r * width + head0, group, slots[r], kv, positions[r] + 1, cache,
                   scale, scores, acc);
    }
  });
}

}  // namespace specstand
