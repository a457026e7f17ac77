// Batch-invariant linear y[m, n] = sum_k x[m, k] * W[n, k] on packed bf16 weights, fp32 accumulation.
#pragma once

#include <torch/extension.h>

#include "common.h"

namespace specstand {

// Weights packed once at load: strips of 16 output columns, each strip k-pair major,
// [n_pad / 16][k_pad / 2][16 columns][2 k] bf16. One 64-byte load holds two k of 16 columns: the operand
// of vdpbf16ps as it is, and two fp32 vectors of 8 columns each after a shift or a mask on AVX2.
struct PackedLinear {
  int64_t n = 0, k = 0, n_pad = 0, k_pad = 0;
  Isa isa = Isa::scalar;
  at::Tensor data;               // bf16 storage, 64-byte aligned by torch's CPU allocator
  const uint16_t* base = nullptr;  // data's first element, read in the tile loops

  const uint16_t* strip(int64_t s) const { return base + s * k_pad * 16; }
};

PackedLinear pack_linear(const at::Tensor& weight, Isa isa);

// x: m rows of k floats (row stride x_stride); y: m rows of n floats (row stride y_stride).
// Every y element is computed by the same instructions whatever m is; threads split the columns.
void linear(const PackedLinear& w, const float* x, int64_t m, int64_t x_stride, float* y, int64_t y_stride);

// A register-only loop of the path's multiply-accumulate instruction: multiply-accumulates per second
// on one core (the compute roofline).
double peak_macs_per_second(Isa isa, int64_t iterations);

}  // namespace specstand
