// Loads of eight 16-bit floats widened to float32 in registers, so the kernel
// reads float16 and bfloat16 rows in place, and stores that narrow them back
// (MLX's scalar conversions cost a few nanoseconds per element). Compiled
// into every instruction-set variant of the kernel; the instructions used
// depend on the flags that variant is compiled with.
#pragma once

#include <bit>
#include <cstdint>
#include <cstring>

#include "cpu/vector_math.h"
#include "mlx/types/half_types.h"

#if defined(__AVX2__) && defined(__F16C__)
#include <immintrin.h>
#endif

namespace mlx_batched_decode::cpu::MBD_CPU_ISA {

namespace mx = mlx::core;

// IEEE half bits to float without branches, so the loop below vectorises on
// any SIMD ISA: rebias the exponent by one multiply (exact, subnormals included),
// then patch inf/NaN, which the multiply would turn into finite values.
inline float half_bits_to_float(uint16_t h) {
  uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  uint32_t em = h & 0x7fffu;
  uint32_t bits = std::bit_cast<uint32_t>(std::bit_cast<float>(em << 13) * 0x1p112f);
  bits = em >= 0x7c00u ? ((em << 13) | 0x7f800000u) : bits;
  return std::bit_cast<float>(bits | sign);
}

inline f32x8 load8(const mx::float16_t* p) {
#if defined(__AVX2__) && defined(__F16C__)
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
#else
  uint16_t bits[8];
  std::memcpy(bits, p, sizeof(bits));
  f32x8 v;
  for (int i = 0; i < 8; ++i) {
    v[i] = half_bits_to_float(bits[i]);
  }
  return v;
#endif
}

// bfloat16 is the top half of a float32: move each one into the top half of a
// 32-bit lane. One byte shuffle of the row in both halves of the register
// (lanes 0-3 take elements 0-3, lanes 4-7 elements 4-7) instead of a widening
// and a shift: one instruction less per eight elements, about 4% of the
// bfloat16 kernel's time with keys in L2.
inline f32x8 load8(const mx::bfloat16_t* p) {
#if defined(__AVX2__)
  const __m256i both = _mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  const __m256i to_top = _mm256_setr_epi8(
      -128, -128, 0, 1, -128, -128, 2, 3, -128, -128, 4, 5, -128, -128, 6, 7,
      -128, -128, 8, 9, -128, -128, 10, 11, -128, -128, 12, 13, -128, -128, 14, 15);
  return _mm256_castsi256_ps(_mm256_shuffle_epi8(both, to_top));
#else
  uint16_t bits[8];
  std::memcpy(bits, p, sizeof(bits));
  f32x8 v;
  for (int i = 0; i < 8; ++i) {
    v[i] = std::bit_cast<float>(static_cast<uint32_t>(bits[i]) << 16);
  }
  return v;
#endif
}

// Eight float32 lanes rounded to nearest even, as mx::float16_t(float) does.
inline void store8(mx::float16_t* p, f32x8 v) {
#if defined(__AVX2__) && defined(__F16C__)
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm256_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT));
#else
  for (int i = 0; i < 8; ++i) {
    p[i] = static_cast<mx::float16_t>(v[i]);
  }
#endif
}

// Eight float32 lanes as mx::bfloat16_t(float) converts them: round the top
// half to nearest even, NaN to MLX's bfloat16 NaN. Plain vector code that any
// SIMD ISA lowers.
inline void store8(mx::bfloat16_t* p, f32x8 v) {
  typedef uint32_t u32x8 __attribute__((vector_size(32)));
  typedef uint16_t u16x8 __attribute__((vector_size(16)));
  const u32x8 bits = (u32x8)v;
  const u32x8 rounded = (bits + ((bits >> 16) & 1u) + 0x7fffu) >> 16;
  const u32x8 nan = (u32x8)(v != v);
  const u16x8 narrow = __builtin_convertvector((nan & __MLX_BFLOAT_NAN__) | (~nan & rounded), u16x8);
  std::memcpy(p, &narrow, sizeof(narrow));
}

} // namespace mlx_batched_decode::cpu::MBD_CPU_ISA
