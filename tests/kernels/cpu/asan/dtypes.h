// The drivers' 16-bit dtypes: floats exact in bfloat16 or float16 as their
// bits and back, and floats rounded to a dtype.
#pragma once

#include <bit>
#include <cstddef>
#include <cstdint>
#include <vector>

#include "cpu/decode_args.h"

namespace driver_dtypes {

using mlx_batched_decode::cpu::Dtype;

// The compiler's float16 (GCC 12 has _Float16 in C++ on x86-64 only).
#if defined(__aarch64__)
using half = __fp16;
#else
using half = _Float16;
#endif

// x (exact in bfloat16 or float16) as the dtype's bits, and back.
inline uint16_t to_bits(float x, Dtype dtype) {
  return dtype == Dtype::bfloat16 ? uint16_t(std::bit_cast<uint32_t>(x) >> 16)
                                  : std::bit_cast<uint16_t>(static_cast<half>(x));
}

inline float from_bits(uint16_t bits, Dtype dtype) {
  return dtype == Dtype::bfloat16 ? std::bit_cast<float>(uint32_t(bits) << 16)
                                  : static_cast<float>(std::bit_cast<half>(bits));
}

// x rounded to the dtype (to nearest, ties to even).
inline float rounded(float x, Dtype dtype) {
  if (dtype == Dtype::float32) {
    return x;
  }
  if (dtype == Dtype::float16) {
    return static_cast<float>(static_cast<half>(x));
  }
  const uint32_t u = std::bit_cast<uint32_t>(x);
  return std::bit_cast<float>((u + 0x7fff + ((u >> 16) & 1)) & 0xffff0000u);
}

// n elements of a dtype as the kernel writes them (float32 values or 16-bit
// bits), read back as floats.
struct DtypeArray {
  Dtype dtype;
  std::vector<float> f32;
  std::vector<uint16_t> bits;

  DtypeArray(Dtype dtype, size_t n)
      : dtype(dtype), f32(dtype == Dtype::float32 ? n : 0), bits(dtype == Dtype::float32 ? 0 : n) {}
  void* data() {
    return dtype == Dtype::float32 ? static_cast<void*>(f32.data()) : bits.data();
  }
  float at(size_t i) const {
    return dtype == Dtype::float32 ? f32[i] : from_bits(bits[i], dtype);
  }
};

} // namespace driver_dtypes
