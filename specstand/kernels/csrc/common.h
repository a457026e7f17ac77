// Shared helpers of the kernels: ISA selection, bf16 conversion, an 8-lane float vector.
#pragma once

#include <sys/syscall.h>
#include <unistd.h>

#include <cmath>
#include <cstdint>
#include <cstring>

namespace specstand {

// Instruction paths of the linear kernel, best last. Every path computes each output element with a
// sequence of instructions that does not depend on how many rows share the call (batch invariance).
enum class Isa : int { scalar = 0, avx2 = 1, avx512bf16 = 2, amx = 3 };

// Linux hands a process the AMX tile registers only on request (arch_prctl ARCH_REQ_XCOMP_PERM).
inline bool amx_permitted() {
#if defined(__linux__) && defined(__x86_64__)
  static const bool granted = syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XTILEDATA */) == 0;
  return granted;
#else
  return false;
#endif
}

inline bool cpu_has(Isa isa) {
  switch (isa) {
    case Isa::scalar:
      return true;
    case Isa::avx2:
      return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
    case Isa::avx512bf16:
      return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
             __builtin_cpu_supports("avx512bf16");
    case Isa::amx:
      return __builtin_cpu_supports("amx-tile") && __builtin_cpu_supports("amx-bf16") && amx_permitted();
  }
  return false;
}

inline const char* isa_name(Isa isa) {
  switch (isa) {
    case Isa::scalar: return "scalar";
    case Isa::avx2: return "avx2";
    case Isa::avx512bf16: return "avx512bf16";
    case Isa::amx: return "amx";
  }
  return "?";
}

inline float bf16_to_float(uint16_t v) {
  uint32_t bits = uint32_t(v) << 16;
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

// Round to nearest even, as torch's .to(torch.bfloat16) does.
inline uint16_t float_to_bf16(float f) {
  uint32_t bits;
  std::memcpy(&bits, &f, 4);
  if ((bits & 0x7fffffffu) > 0x7f800000u) return 0x7fc0;  // NaN stays NaN
  bits += 0x7fffu + ((bits >> 16) & 1u);
  return uint16_t(bits >> 16);
}

// Eight float lanes with GCC vector extensions. Built with -ffp-contract=off, every lane op is one IEEE
// operation, so results are the same whatever ISA the compiler lowers it to (SSE pairs or AVX).
typedef float v8f __attribute__((vector_size(32)));
typedef int32_t v8i __attribute__((vector_size(32)));

inline v8f v8_load(const float* p) {
  v8f v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}
inline void v8_store(float* p, v8f v) { std::memcpy(p, &v, sizeof(v)); }
inline v8f v8_splat(float x) { return v8f{x, x, x, x, x, x, x, x}; }

// Fixed-order horizontal sum.
inline float v8_sum(v8f v) { return ((v[0] + v[4]) + (v[2] + v[6])) + ((v[1] + v[5]) + (v[3] + v[7])); }

// exp on 8 lanes: round-to-nearest range reduction by ln 2 and a degree-6 Taylor polynomial on
// |r| <= ln2/2 (about 1 ulp). Inputs are clamped to the finite range of float.
inline v8f v8_exp(v8f x) {
  const v8f lo = v8_splat(-87.3f), hi = v8_splat(88.3f);
  x = x < lo ? lo : x;
  x = x > hi ? hi : x;
  const v8f magic = v8_splat(12582912.0f);  // 1.5 * 2^23: adding it rounds to an integer
  v8f n = (x * v8_splat(1.44269504f) + magic) - magic;
  v8f r = x - n * v8_splat(0.693145752f);
  r = r - n * v8_splat(1.42860677e-06f);
  v8f p = v8_splat(1.0f / 720.0f);
  p = p * r + v8_splat(1.0f / 120.0f);
  p = p * r + v8_splat(1.0f / 24.0f);
  p = p * r + v8_splat(1.0f / 6.0f);
  p = p * r + v8_splat(0.5f);
  p = p * r + v8_splat(1.0f);
  p = p * r + v8_splat(1.0f);
  v8i bits = (__builtin_convertvector(n, v8i) + 127) << 23;
  v8f scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  return p * scale;
}

}  // namespace specstand
