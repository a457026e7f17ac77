// Batch-invariant linear y[m, n] = sum_k x[m, k] * W[n, k] on packed bf16 weights, fp32 accumulation.
#pragma once

// ATen's Tensor alone, not torch/extension.h (about 30 s of compile for each file that includes it)
#include <ATen/core/Tensor.h>

#include "common.h"

namespace specstand {

// How a packed weight stores its values.
//   bf16: one bf16 per weight.
//   q8_0: GGUF's Q8_0 blocks: per output column, 32 consecutive k share an fp16 scale d and each weight is
//         d * q with q an int8; 1.0625 bytes a weight.
enum class Format : int { bf16 = 0, q8_0 = 1 };

// Weights packed once at load: strips of 16 output columns, each strip k-pair major,
// [n_pad / 16][k_pad / 2][16 columns][2 k]. bf16: one 64-byte load holds two k of 16 columns, the operand
// of vdpbf16ps as it is, and two fp32 vectors of 8 columns each after a shift or a mask on AVX2. q8_0: int8
// in the same k-pair order (avx2, scalar) or k-quad order [k_pad / 4][16 columns][4 k] of q + 128 (the
// unsigned operand of vpdpbusd and tdpbsud), and per strip the scales [k_pad / 32 blocks][16 columns] fp16.
struct PackedLinear {
  int64_t n = 0, k = 0, n_pad = 0, k_pad = 0;
  Isa isa = Isa::scalar;
  Format format = Format::bf16;
  at::Tensor data;                 // bf16 or int8 storage, 64-byte aligned by torch's CPU allocator
  at::Tensor scales;               // q8_0: fp16 block scales
  const uint16_t* base = nullptr;  // data's first element, read in the tile loops
  const int8_t* qbase = nullptr;
  const uint16_t* scale_base = nullptr;

  const uint16_t* strip(int64_t s) const { return base + s * k_pad * 16; }
  const int8_t* q_strip(int64_t s) const { return qbase + s * k_pad * 16; }
  const uint16_t* scale_strip(int64_t s) const { return scale_base + s * (k_pad / 32) * 16; }
};

PackedLinear pack_linear(const at::Tensor& weight, Isa isa);
// q: [n, k] int8, d: [n, ceil(k / 32)] fp16 (the scale of each column's block of 32 k).
PackedLinear pack_linear_q8_0(const at::Tensor& q, const at::Tensor& d, Isa isa);

// x: m rows of k floats (row stride x_stride); y: m rows of n floats (row stride y_stride).
// Every y element is computed by the same instructions whatever m is; threads split the columns.
void linear(const PackedLinear& w, const float* x, int64_t m, int64_t x_stride, float* y, int64_t y_stride);
void linear_q8_0(const PackedLinear& w, const float* x, int64_t m, int64_t x_stride, float* y, int64_t y_stride);

// The amx path's activation tiles, [ceil(m / 16)][k_pad / 32][16 rows][32 k] bf16 (rows past m are 0): a linear from
// activations already in that order (bf16 weights on amx).
void linear_from_tiles(const PackedLinear& w, const uint16_t* tiles, int64_t m, float* y, int64_t y_stride);
// Whether linear_silu_mul runs this fused [gate | up] weight (amx, bf16, 2I a multiple of 64).
bool fuses_silu_mul(const PackedLinear& gate_up);
// act = silu(x Wg^T) * (x Wu^T) for the weight [gate | up] of width 2I, rounded to bf16 into act in the tile order
// above (k = I): bit for bit what linear, silu_mul and linear's own rounding of act into tiles give.
void linear_silu_mul(const PackedLinear& gate_up, const float* x, int64_t m, int64_t x_stride, uint16_t* act);

// A register-only loop of the path's multiply-accumulate instruction: multiply-accumulates per second
// on one core (the compute roofline).
double peak_macs_per_second(Isa isa, int64_t iterations);
// The same for the q8_0 kernel of `isa` (`tiles`: the AMX-INT8 loop it takes from 16 rows), counting one
// weight-activation product as the kernel computes it (two int8 products on the AVX-512 paths).
double peak_macs_per_second_q8_0(Isa isa, bool tiles, int64_t iterations);

}  // namespace specstand
