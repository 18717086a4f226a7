// Small float32 vector kernels written so the compiler vectorises them with
// whatever SIMD ISA the including translation unit is compiled for.
#pragma once

#include <bit>
#include <cstdint>

namespace mlx_batched_decode::cpu {

// exp(x) for a block of values in place, branch-free so the loop vectorises
// (libm's expf is a call per element). Cephes' polynomial, ~1 ulp; NaN stays
// NaN; arguments below -87.3 (where expf is subnormal), -inf included, give 0.
inline void exp_inplace(float* __restrict x, int n) {
#pragma omp simd
  for (int i = 0; i < n; ++i) {
    const float in = x[i];
    const bool nan = in != in;
    float v = nan ? 0.0f : in;
    v = v < -87.3f ? -87.3f : (v > 88.3f ? 88.3f : v);
    // k = round(v / ln 2) with the 1.5 * 2^23 trick (vectorises without SSE4.1).
    const float k = (v * 1.44269504089f + 12582912.0f) - 12582912.0f;
    const float r = (v - k * 0.693359375f) + k * 2.12194440e-4f;
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.0f;
    const float two_k = std::bit_cast<float>(static_cast<uint32_t>(static_cast<int32_t>(k) + 127) << 23);
    x[i] = nan ? in : (in < -87.3f ? 0.0f : p * two_k);
  }
}

// out[j] = dot(q, rows[j]) for j < n. Four rows at a time: four independent
// accumulator chains hide the FMA latency that a single dot is bound by.
template <int D>
inline void dot_rows(const float* __restrict q, const float* const* rows, int n, float* out) {
  int j = 0;
  for (; j + 4 <= n; j += 4) {
    const float* __restrict r0 = rows[j];
    const float* __restrict r1 = rows[j + 1];
    const float* __restrict r2 = rows[j + 2];
    const float* __restrict r3 = rows[j + 3];
    float s0 = 0.0f, s1 = 0.0f, s2 = 0.0f, s3 = 0.0f;
#pragma omp simd reduction(+ : s0, s1, s2, s3)
    for (int i = 0; i < D; ++i) {
      s0 += q[i] * r0[i];
      s1 += q[i] * r1[i];
      s2 += q[i] * r2[i];
      s3 += q[i] * r3[i];
    }
    out[j] = s0;
    out[j + 1] = s1;
    out[j + 2] = s2;
    out[j + 3] = s3;
  }
  for (; j < n; ++j) {
    const float* __restrict r = rows[j];
    float s = 0.0f;
#pragma omp simd reduction(+ : s)
    for (int i = 0; i < D; ++i) {
      s += q[i] * r[i];
    }
    out[j] = s;
  }
}

// acc += sum_j w[j] * rows[j] for j < n, four rows per pass over acc so that
// acc is loaded and stored once per four rows.
template <int D>
inline void accumulate_rows(float* __restrict acc, const float* w, const float* const* rows, int n) {
  int j = 0;
  for (; j + 4 <= n; j += 4) {
    const float* __restrict r0 = rows[j];
    const float* __restrict r1 = rows[j + 1];
    const float* __restrict r2 = rows[j + 2];
    const float* __restrict r3 = rows[j + 3];
    const float w0 = w[j], w1 = w[j + 1], w2 = w[j + 2], w3 = w[j + 3];
#pragma omp simd
    for (int i = 0; i < D; ++i) {
      acc[i] += w0 * r0[i] + w1 * r1[i] + w2 * r2[i] + w3 * r3[i];
    }
  }
  for (; j < n; ++j) {
    const float* __restrict r = rows[j];
    const float wj = w[j];
#pragma omp simd
    for (int i = 0; i < D; ++i) {
      acc[i] += wj * r[i];
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
