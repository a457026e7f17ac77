// Attention of a few query rows per request over that request's own cache length.
#pragma once

#include <cstdint>

#include "common.h"

namespace specstand {

struct CacheView {
  const uint16_t* keys;  // one layer, bf16: [slots][kv_heads][capacity][head_dim]
  const uint16_t* values;
  int64_t slots, kv_heads, capacity, head_dim;

  const uint16_t* key(int64_t slot, int64_t head, int64_t pos) const {
    return keys + ((slot * kv_heads + head) * capacity + pos) * head_dim;
  }
  const uint16_t* value(int64_t slot, int64_t head, int64_t pos) const {
    return values + ((slot * kv_heads + head) * capacity + pos) * head_dim;
  }
};

// q: rows of heads * head_dim queries, q_stride floats apart; out: [rows][heads * head_dim]. Row r attends
// over positions 0..positions[r] of cache slot slots[r]. A row's result depends on its own query and cache
// entries alone: no padding, no shared reduction. `isa` is the linear's path: avx512bf16 and amx CPUs take
// the AVX-512 attention (head_dim 16..256), avx2 its own (head_dim a multiple of 8), scalar the portable one.
void decode_attention(Isa isa, const float* q, int64_t q_stride, float* out, int64_t rows, int64_t heads,
                      const int64_t* slots, const int64_t* positions, const CacheView& cache, float scale);

}  // namespace specstand
