// Small float32 vector kernels, vectorised for whatever SIMD ISA the including
// translation unit is compiled for.
#pragma once

#include <algorithm>
#include <cstdint>
#include <cmath>
#include <cstring>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace mlx_batched_decode::cpu::MBD_CPU_ISA {

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

// Returns v, loaded into a register once. Without this GCC folds the load into
// each FMA that uses v, and the repeated loads, not the FMAs, bound the loop.
inline f32x8 in_register(f32x8 v) {
#if defined(__AVX__)
  asm("" : "+x"(v));
#endif
  return v;
}

typedef int32_t i32x8 __attribute__((vector_size(32)));

// Not f32x8{} + s: that add cannot be folded away (0 + -0 is +0), and it
// costs a scalar add before every broadcast.
inline f32x8 splat(float s) {
  return f32x8{s, s, s, s, s, s, s, s};
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

// cap * tanh(x / cap) on eight lanes, as cap - 2 cap / (exp(2 x / cap) + 1):
// exp8 saturates, so large |x| (infinities included) gives +-cap; NaN stays NaN.
inline f32x8 softcap8(f32x8 x, float cap) {
  return splat(cap) - splat(2.0f * cap) / (exp8(x * (2.0f / cap)) + 1.0f);
}

// Caps scores x[0, n) in place (softcap8); x must have room for n rounded up to 8.
inline void softcap_scores(float* x, int n, float cap) {
  for (int j = 0; j < n; j += 8) {
    store8(x + j, softcap8(load8(x + j), cap));
  }
}

// Larger of a and b lane by lane, ignoring NaN in b like std::max(a, b).
inline f32x8 max8(f32x8 a, f32x8 b) {
  return select(a < b, b, a);
}

#if defined(__AVX512F__)
// exp on 16 lanes, the algorithm of vector_math.h's exp8 with AVX-512 masks:
// Cephes' polynomial, ~1 ulp; NaN stays NaN; x < -87.3 (-inf included) gives 0.
inline __m512 exp16(__m512 x) {
  const __mmask16 nan = _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q);
  const __mmask16 underflow = _mm512_cmp_ps_mask(x, _mm512_set1_ps(-87.3f), _CMP_LT_OQ);
  const __m512 v = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-87.3f)), _mm512_set1_ps(88.3f));
  // k = round(v / ln 2): adding 1.5 * 2^23 leaves k in the low mantissa bits.
  const __m512 shifted = _mm512_fmadd_ps(v, _mm512_set1_ps(1.44269504089f), _mm512_set1_ps(12582912.0f));
  const __m512 k = _mm512_sub_ps(shifted, _mm512_set1_ps(12582912.0f));
  const __m512i k_int = _mm512_sub_epi32(_mm512_castps_si512(shifted), _mm512_castps_si512(_mm512_set1_ps(12582912.0f)));
  const __m512 r = _mm512_fmadd_ps(k, _mm512_set1_ps(2.12194440e-4f), _mm512_fnmadd_ps(k, _mm512_set1_ps(0.693359375f), v));
  __m512 p = _mm512_set1_ps(1.9875691500e-4f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
  p = _mm512_add_ps(_mm512_fmadd_ps(_mm512_mul_ps(p, r), r, r), _mm512_set1_ps(1.0f));
  const __m512 two_k = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_add_epi32(k_int, _mm512_set1_epi32(127)), 23));
  return _mm512_mask_blend_ps(nan, _mm512_maskz_mul_ps(static_cast<__mmask16>(~underflow), p, two_k), x);
}

// softcap8 on 16 lanes.
inline __m512 softcap16(__m512 x, float cap) {
  const __m512 e = exp16(_mm512_mul_ps(x, _mm512_set1_ps(2.0f / cap)));
  return _mm512_sub_ps(_mm512_set1_ps(cap),
                       _mm512_div_ps(_mm512_set1_ps(2.0f * cap), _mm512_add_ps(e, _mm512_set1_ps(1.0f))));
}

// One block of the online softmax of one head over scores x[0, n).
// Updates the running max m and sum l, turns x into weights exp(x - m_new)
// and returns alpha = exp(m_old - m_new), the factor for the old accumulator.
// x must have room for n rounded up to 16; lanes past n are set to weight 0.
// 16 lanes where AVX-512 has them: half the instructions of 8. RoundBf16:
// each weight is rounded to bfloat16 before it joins l, for value loops that
// multiply in bfloat16 (accumulate_pairs): l then sums the weights they use.
template <bool RoundBf16 = false>
inline float softmax_block(float* x, int n, float& m, float& l) {
  const float neg_inf = -INFINITY;
  const int n16 = (n + 15) & ~15;
  for (int j = n; j < n16; ++j) {
    x[j] = neg_inf;
  }
  __m512 mv = _mm512_set1_ps(m);
  for (int j = 0; j < n16; j += 16) {
    // NaN scores do not become the max, like std::max(m, NaN).
    const __m512 v = _mm512_loadu_ps(x + j);
    mv = _mm512_mask_blend_ps(_mm512_cmp_ps_mask(mv, v, _CMP_LT_OQ), mv, v);
  }
  const float m_new = _mm512_reduce_max_ps(mv);
  // A -inf score (or max) must give weight 0, not exp(-inf + inf) = NaN.
  const float alpha = m == neg_inf ? 0.0f : std::exp(m - m_new);
  const __m512 mn = _mm512_set1_ps(m_new);
  __m512 sum = _mm512_setzero_ps();
  for (int j = 0; j < n16; j += 16) {
    const __m512 v = _mm512_loadu_ps(x + j);
    const __mmask16 outside = _mm512_cmp_ps_mask(v, _mm512_set1_ps(neg_inf), _CMP_EQ_OQ);
    __m512 w = exp16(_mm512_mask_sub_ps(v, static_cast<__mmask16>(~outside), v, mn));
    if constexpr (RoundBf16) {
#if defined(__AVX512BF16__)
      const __m256i b = (__m256i)(_mm512_cvtneps_pbh(w));
      w = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(b), 16));
#else
      static_assert(!RoundBf16, "bfloat16 weights need AVX512_BF16");
#endif
    }
    _mm512_storeu_ps(x + j, w);
    sum = _mm512_add_ps(sum, w);
  }
  l = l * alpha + _mm512_reduce_add_ps(sum);
  m = m_new;
  return alpha;
}
#else
// One block of the online softmax of one head over scores x[0, n).
// Updates the running max m and sum l, turns x into weights exp(x - m_new)
// and returns alpha = exp(m_old - m_new), the factor for the old accumulator.
// x must have room for n rounded up to 8; lanes past n are set to weight 0.
template <bool RoundBf16 = false>
inline float softmax_block(float* x, int n, float& m, float& l) {
  static_assert(!RoundBf16, "bfloat16 weights are an AVX-512 path");
  const float neg_inf = -INFINITY;
  const int n8 = (n + 7) & ~7;
  for (int j = n; j < n8; ++j) {
    x[j] = neg_inf;
  }
  f32x8 mv = splat(m);
  for (int j = 0; j < n8; j += 8) {
    mv = max8(mv, load8(x + j));
  }
  float m_new = mv[0];
  for (int c = 1; c < 8; ++c) {
    m_new = std::max(m_new, mv[c]);
  }
  // A -inf score (or max) must give weight 0, not exp(-inf + inf) = NaN.
  const float alpha = m == neg_inf ? 0.0f : std::exp(m - m_new);
  f32x8 sum = {};
  for (int j = 0; j < n8; j += 8) {
    const f32x8 v = load8(x + j);
    const f32x8 w = exp8(select(v == splat(neg_inf), v, v - m_new));
    store8(x + j, w);
    sum += w;
  }
  l = l * alpha + sum8(sum);
  m = m_new;
  return alpha;
}
#endif

inline void axpy(float* __restrict y, float a, const float* __restrict x, int n) {
#pragma omp simd
  for (int i = 0; i < n; ++i) {
    y[i] += a * x[i];
  }
}

} // namespace mlx_batched_decode::cpu::MBD_CPU_ISA
