// MSL's bfloat: the top 16 bits of a float32, rounded to nearest even.
#pragma once

#include <cstdint>
#include <cstring>

namespace metal {

struct bfloat {
  uint16_t bits;

  bfloat() = default;
  bfloat(float f) {
    uint32_t u;
    std::memcpy(&u, &f, sizeof(u));
    if ((u & 0x7fffffffu) > 0x7f800000u) {
      bits = uint16_t((u >> 16) | 0x40u);  // keep NaN a (quiet) NaN
    } else {
      bits = uint16_t((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
    }
  }
  operator float() const {
    const uint32_t u = uint32_t(bits) << 16;
    float f;
    std::memcpy(&f, &u, sizeof(f));
    return f;
  }
};

} // namespace metal
