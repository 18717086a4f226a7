// The vectors the kernel's two inner loops (tiles.h) run on, as traits: the
// loops are written once and take one of these as their lane width.
//   Lanes8     8 float32 lanes (vector_math.h's f32x8: one AVX register, two
//              SSE or NEON ones); float16 and bfloat16 rows widened in registers
//   Lanes16    16 float32 lanes, in a variant compiled for AVX-512;
//              float16 widened by VCVTPH2PS, bfloat16 by a shift (both exact)
//   Bf16Pairs  the AVX512_BF16 dot product: bfloat16 rows and queries, 16
//              pairs multiplied exactly and added into 8 float32 lanes per
//              instruction (scores only)
// Every product and sum stays in float32: native half-precision FMAs would
// round each product to 11 bits, which the contract's float32 accumulation
// rules out.
//
// Each trait: Acc (accumulator) and Row (a loaded chunk) vector types, kStep
// elements per chunk, kRawQueries (queries unscaled: scores scaled instead),
// zero, load (a chunk of a row or query, widened and held in a register),
// fma(a, b, acc) = acc + a * b lane by lane (Bf16Pairs: the pairs' dot
// product), sum4 (the four horizontal sums of v[0..3] into out),
// and for the value loops load_acc, store, splat and mul.
#pragma once

#include "cpu/convert.h"
#include "cpu/vector_math.h"

#if defined(__AVX__)
#include <immintrin.h>
#endif

namespace mlx_batched_decode::cpu::MBD_CPU_ISA {

// The four horizontal sums of v[0..3], as {sum8(v[0]), ..., sum8(v[3])}.
// A tree of pairwise adds: about two instructions per sum instead of seven.
inline void sum8x4(const f32x8* v, float* out) {
#if defined(__AVX__)
  const __m256 a = _mm256_hadd_ps(_mm256_hadd_ps(v[0], v[1]), _mm256_hadd_ps(v[2], v[3]));
  _mm_storeu_ps(out, _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1)));
#else
  for (int c = 0; c < 4; ++c) {
    out[c] = sum8(v[c]);
  }
#endif
}

struct Lanes8 {
  using Acc = f32x8;
  using Row = f32x8;
  static constexpr int kStep = 8;
  static constexpr bool kRawQueries = false;

  static Acc zero() {
    return f32x8{};
  }
  template <typename T>
  static Row load(const T* p) {
    return in_register(load8(p));
  }
  static Acc fma(Row a, Row b, Acc acc) {
    return acc + a * b;
  }
  static void sum4(const Acc* v, float* out) {
    sum8x4(v, out);
  }
  static Acc load_acc(const float* p) {
    return load8(p);
  }
  static void store(float* p, Acc v) {
    store8(p, v);
  }
  static Acc splat(float s) {
    return MBD_CPU_ISA::splat(s);
  }
  static Acc mul(Acc a, Acc b) {
    return a * b;
  }
};

#if defined(__AVX512F__)
struct Lanes16 {
  using Acc = __m512;
  using Row = __m512;
  static constexpr int kStep = 16;
  static constexpr bool kRawQueries = false;

  static Acc zero() {
    return _mm512_setzero_ps();
  }
  static __m512 widen(const float* p) {
    return _mm512_loadu_ps(p);
  }
  static __m512 widen(const mx::float16_t* p) {
    return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  }
  // A bfloat16 is the high half of the float32 of the same value.
  static __m512 widen(const mx::bfloat16_t* p) {
    const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
  }
  // As in_register (vector_math.h): one load per use, not one folded into each FMA.
  template <typename T>
  static Row load(const T* p) {
    __m512 v = widen(p);
    asm("" : "+v"(v));
    return v;
  }
  static Acc fma(Row a, Row b, Acc acc) {
    return _mm512_fmadd_ps(a, b, acc);
  }
  // Halves added, then sum8x4.
  static void sum4(const Acc* v, float* out) {
    f32x8 half[4];
    for (int c = 0; c < 4; ++c) {
      half[c] = _mm512_castps512_ps256(v[c]) + _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v[c]), 1));
    }
    sum8x4(half, out);
  }
  static Acc load_acc(const float* p) {
    return _mm512_loadu_ps(p);
  }
  static void store(float* p, Acc v) {
    _mm512_storeu_ps(p, v);
  }
  static Acc splat(float s) {
    return _mm512_set1_ps(s);
  }
  static Acc mul(Acc a, Acc b) {
    return _mm512_mul_ps(a, b);
  }
};
#endif

#if defined(__AVX512BF16__) && defined(__AVX512VL__)
struct Bf16Pairs {
  using Acc = f32x8;
  using Row = __m256bh;
  static constexpr int kStep = 16;
  static constexpr bool kRawQueries = true; // unscaled bfloat16 queries, exact

  static Acc zero() {
    return f32x8{};
  }
  static Row load(const mx::bfloat16_t* p) {
    return (__m256bh)_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  }
  static Acc fma(Row a, Row b, Acc acc) {
    return _mm256_dpbf16_ps(acc, a, b);
  }
  static void sum4(const Acc* v, float* out) {
    sum8x4(v, out);
  }
};
#endif

} // namespace mlx_batched_decode::cpu::MBD_CPU_ISA
