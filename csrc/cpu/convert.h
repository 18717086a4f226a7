// Widening of key/value rows to float32 in registers. Compiled into every
// instruction-set variant of the kernel; the intrinsics used depend on the flags
// that variant is compiled with.
#pragma once

#include <bit>
#include <cstdint>
#include <type_traits>

#include "mlx/types/half_types.h"

#if defined(__F16C__) && defined(__AVX__)
#include <immintrin.h>
#endif

namespace mlx_batched_decode::cpu {

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

inline float bf16_bits_to_float(uint16_t h) {
  return std::bit_cast<float>(static_cast<uint32_t>(h) << 16);
}

// Widens a contiguous row of D 16-bit floats to float32 into dst.
template <typename T, int D>
inline void widen_row(const T* src, float* __restrict dst) {
  static_assert(D % 8 == 0, "head dims are multiples of 8");
  if constexpr (std::is_same_v<T, mx::bfloat16_t>) {
    const auto* bits = reinterpret_cast<const uint16_t*>(src);
    for (int i = 0; i < D; ++i) {
      dst[i] = bf16_bits_to_float(bits[i]);
    }
  } else {
    const auto* bits = reinterpret_cast<const uint16_t*>(src);
#if defined(__F16C__) && defined(__AVX__)
    for (int i = 0; i < D; i += 8) {
      __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(bits + i));
      _mm256_storeu_ps(dst + i, _mm256_cvtph_ps(h));
    }
#else
    for (int i = 0; i < D; ++i) {
      dst[i] = half_bits_to_float(bits[i]);
    }
#endif
  }
}

// Returns row as float32: in place for contiguous float32 rows, otherwise
// widened (or gathered, for a strided last axis) into scratch.
template <typename T, int D>
inline const float* load_row(const T* row, int64_t dim_stride, float* scratch) {
  if (dim_stride == 1) {
    if constexpr (std::is_same_v<T, float>) {
      return row;
    } else {
      widen_row<T, D>(row, scratch);
      return scratch;
    }
  }
  for (int i = 0; i < D; ++i) {
    scratch[i] = static_cast<float>(row[i * dim_stride]);
  }
  return scratch;
}

} // namespace mlx_batched_decode::cpu
