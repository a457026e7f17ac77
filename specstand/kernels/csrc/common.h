// Shared helpers of the kernels: ISA selection, bf16 conversion, an 8-lane float vector.
#pragma once

#include <sys/syscall.h>
#include <unistd.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <new>
#include <vector>

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

// Storage aligned to a cache line: a 64-byte AMX tile row read from it never straddles two lines (from a plain
// std::vector, 16 bytes off, every row of a tile load did, about 20% of a tile loop's time).
template <typename T>
struct CacheLineAllocator {
  using value_type = T;
  CacheLineAllocator() = default;
  template <typename U>
  CacheLineAllocator(const CacheLineAllocator<U>&) {}
  T* allocate(std::size_t n) { return static_cast<T*>(::operator new(n * sizeof(T), std::align_val_t(64))); }
  void deallocate(T* p, std::size_t) { ::operator delete(p, std::align_val_t(64)); }
  template <typename U>
  bool operator==(const CacheLineAllocator<U>&) const { return true; }
  template <typename U>
  bool operator!=(const CacheLineAllocator<U>&) const { return false; }
};
template <typename T>
using AlignedVector = std::vector<T, CacheLineAllocator<T>>;

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

// IEEE half to float, exactly (every half is a float); the scales of Q8_0 blocks are stored so.
inline float fp16_to_float(uint16_t h) {
  const uint32_t sign = uint32_t(h & 0x8000u) << 16, exponent = (h >> 10) & 0x1fu, mantissa = h & 0x3ffu;
  float magnitude;
  if (exponent == 0) {
    magnitude = std::ldexp(float(mantissa), -24);  // zero or subnormal
  } else if (exponent == 31) {
    magnitude = mantissa ? NAN : INFINITY;
  } else {
    magnitude = std::ldexp(float(mantissa | 0x400u), int(exponent) - 25);
  }
  uint32_t bits;
  std::memcpy(&bits, &magnitude, 4);
  bits |= sign;
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

// Eight and sixteen float lanes with GCC vector extensions. Built with -ffp-contract=off, every lane op
// is one IEEE operation, so results are the same whatever ISA the compiler lowers it to (SSE pairs or AVX).
typedef float v8f __attribute__((vector_size(32)));
typedef int32_t v8i __attribute__((vector_size(32)));
typedef float v16f __attribute__((vector_size(64)));
typedef int32_t v16i __attribute__((vector_size(64)));

#define SPECSTAND_INLINE inline __attribute__((always_inline))

SPECSTAND_INLINE v8f v8_load(const float* p) {
  v8f v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}
SPECSTAND_INLINE void v8_store(float* p, v8f v) { std::memcpy(p, &v, sizeof(v)); }
// Eight bf16 values widened to fp32 (exact: the bits move up by 16).
SPECSTAND_INLINE v8f v8_load_bf16(const uint16_t* p) {
  typedef uint16_t v8h __attribute__((vector_size(16)));
  v8h raw;
  std::memcpy(&raw, p, sizeof(raw));
  const v8i bits = __builtin_convertvector(raw, v8i) << 16;
  v8f v;
  std::memcpy(&v, &bits, sizeof(v));
  return v;
}
SPECSTAND_INLINE v8f v8_splat(float x) { return v8f{} + x; }
SPECSTAND_INLINE v16f v16_splat(float x) { return v16f{} + x; }

// Fixed-order horizontal sums.
SPECSTAND_INLINE float v8_sum(v8f v) { return ((v[0] + v[4]) + (v[2] + v[6])) + ((v[1] + v[5]) + (v[3] + v[7])); }
SPECSTAND_INLINE float v16_sum(v16f v) {
  const v8f low = {v[0], v[1], v[2], v[3], v[4], v[5], v[6], v[7]};
  const v8f high = {v[8], v[9], v[10], v[11], v[12], v[13], v[14], v[15]};
  return v8_sum(low + high);
}

template <typename V> struct LaneInts;
template <> struct LaneInts<v8f> { using type = v8i; };
template <> struct LaneInts<v16f> { using type = v16i; };

// exp on every lane: round-to-nearest range reduction by ln 2 and a degree-6 Taylor polynomial on
// |r| <= ln2/2 (about 1 ulp). Inputs are clamped to the finite range of float.
template <typename V>
SPECSTAND_INLINE V vec_exp(V x) {
  using I = typename LaneInts<V>::type;
  const V lo = V{} + -87.3f, hi = V{} + 88.3f;
  x = x < lo ? lo : x;
  x = x > hi ? hi : x;
  const V magic = V{} + 12582912.0f;  // 1.5 * 2^23: adding it rounds to an integer
  V n = (x * 1.44269504f + magic) - magic;
  V r = x - n * 0.693145752f;
  r = r - n * 1.42860677e-06f;
  V p = V{} + 1.0f / 720.0f;
  p = p * r + 1.0f / 120.0f;
  p = p * r + 1.0f / 24.0f;
  p = p * r + 1.0f / 6.0f;
  p = p * r + 0.5f;
  p = p * r + 1.0f;
  p = p * r + 1.0f;
  I bits = (__builtin_convertvector(n, I) + 127) << 23;
  V scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  return p * scale;
}

// silu(g) * u on every lane: the MLP's activation, one definition for the decoder's row loop and the amx linear's
// fused epilogue, so that both give the same bits.
template <typename V>
SPECSTAND_INLINE V silu_mul(V g, V u) {
  return (g / ((V{} + 1.0f) + vec_exp(-g))) * u;
}

}  // namespace specstand
