// Small float32 vector kernels, vectorised for whatever SIMD ISA the including
// translation unit is compiled for.
#pragma once

#include <bit>
#include <cstdint>
#include <cmath>
#include <cstring>

namespace mlx_batched_decode::cpu {

// Eight floats in one vector; GCC and Clang lower it to the widest SIMD the
// translation unit is compiled for (one AVX register, two SSE or NEON ones).
// Explicit vectors, because the auto-vectoriser kept scalar loops here.
typedef float f32x8 __attribute__((vector_size(32)));

inline f32x8 load8(const float* p) {
  f32x8 v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}

inline void store8(float* p, f32x8 v) {
  std::memcpy(p, &v, sizeof(v));
}

inline float sum8(f32x8 v) {
  return ((v[0] + v[4]) + (v[1] + v[5])) + ((v[2] + v[6]) + (v[3] + v[7]));
}

typedef int32_t i32x8 __attribute__((vector_size(32)));

inline f32x8 splat(float s) {
  return f32x8{} + s;
}

// mask ? a : b, lane by lane, for a comparison mask (all ones or all zeros).
inline f32x8 select(i32x8 mask, f32x8 a, f32x8 b) {
  return (f32x8)((mask & (i32x8)a) | (~mask & (i32x8)b));
}

// exp(x) on eight lanes without branches (libm's expf is a call per element).
// Cephes' polynomial, ~1 ulp; NaN stays NaN; x < -87.3 (where expf is
// subnormal), -inf included, gives 0.
inline f32x8 exp8(f32x8 x) {
  const i32x8 nan = x != x;
  const i32x8 underflow = x < splat(-87.3f);
  f32x8 v = select(nan, splat(0.0f), x);
  v = select(v < splat(-87.3f), splat(-87.3f), v);
  v = select(v > splat(88.3f), splat(88.3f), v);
  // k = round(v / ln 2): adding 1.5 * 2^23 leaves k in the low mantissa bits.
  const f32x8 shifted = v * 1.44269504089f + 12582912.0f;
  const f32x8 k = shifted - 12582912.0f;
  const i32x8 k_int = (i32x8)shifted - (i32x8)splat(12582912.0f);
  const f32x8 r = (v - k * 0.693359375f) + k * 2.12194440e-4f;
  f32x8 p = splat(1.9875691500e-4f);
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  const f32x8 two_k = (f32x8)((k_int + 127) << 23);
  return select(nan, x, select(underflow, splat(0.0f), p * two_k));
}

// x[j] = exp(x[j] - m) for j < n, with exp(-inf - m) = 0 even when m is -inf.
// Works on whole groups of eight: x must have room for n rounded up to 8.
inline void exp_minus(float* x, int n, float m) {
  for (int j = 0; j < n; j += 8) {
    const f32x8 v = load8(x + j);
    store8(x + j, exp8(select(v == splat(-INFINITY), v, v - m)));
  }
}

// out[j] = dot(q, rows[j]) for j < n. Four rows at a time: four independent
// accumulator chains hide the FMA latency that a single dot is bound by.
template <int D>
inline void dot_rows(const float* q, const float* const* rows, int n, float* out) {
  static_assert(D % 8 == 0, "head dims are multiples of 8");
  int j = 0;
  for (; j + 4 <= n; j += 4) {
    const float *r0 = rows[j], *r1 = rows[j + 1], *r2 = rows[j + 2], *r3 = rows[j + 3];
    f32x8 s0 = {}, s1 = {}, s2 = {}, s3 = {};
    for (int i = 0; i < D; i += 8) {
      const f32x8 qi = load8(q + i);
      s0 += qi * load8(r0 + i);
      s1 += qi * load8(r1 + i);
      s2 += qi * load8(r2 + i);
      s3 += qi * load8(r3 + i);
    }
    out[j] = sum8(s0);
    out[j + 1] = sum8(s1);
    out[j + 2] = sum8(s2);
    out[j + 3] = sum8(s3);
  }
  for (; j < n; ++j) {
    f32x8 s = {};
    for (int i = 0; i < D; i += 8) {
      s += load8(q + i) * load8(rows[j] + i);
    }
    out[j] = sum8(s);
  }
}

// acc += sum_j w[j] * rows[j] for j < n, four rows per pass over acc so that
// acc is loaded and stored once per four rows.
template <int D>
inline void accumulate_rows(float* acc, const float* w, const float* const* rows, int n) {
  int j = 0;
  for (; j + 4 <= n; j += 4) {
    // Locals, so stores to acc cannot force the row pointers to be reloaded.
    const float *r0 = rows[j], *r1 = rows[j + 1], *r2 = rows[j + 2], *r3 = rows[j + 3];
    const float w0 = w[j], w1 = w[j + 1], w2 = w[j + 2], w3 = w[j + 3];
    for (int i = 0; i < D; i += 8) {
      f32x8 a = load8(acc + i);
      a += w0 * load8(r0 + i) + w1 * load8(r1 + i);
      a += w2 * load8(r2 + i) + w3 * load8(r3 + i);
      store8(acc + i, a);
    }
  }
  for (; j < n; ++j) {
    for (int i = 0; i < D; i += 8) {
      store8(acc + i, load8(acc + i) + w[j] * load8(rows[j] + i));
    }
  }
}

template <int D>
inline void axpy(float* __restrict y, float a, const float* __restrict x) {
#pragma omp simd
  for (int i = 0; i < D; ++i) {
    y[i] += a * x[i];
  }
}

} // namespace mlx_batched_decode::cpu
