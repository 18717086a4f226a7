// The kernel's two inner loops (tiles.h) on 16-lane float32 vectors, for
// float16 rows in a variant compiled for AVX512-FP16. Keys and values are
// widened by one conversion per 16 elements (VCVTPH2PSX, exact) and every
// product and sum stays in float32, as in the 8-lane loops: native half
// precision FMAs would round each product to 11 bits and each partial sum
// to half precision, which the contract's float32 accumulation rules out.
// What the variant saves is instructions: half the conversions, FMAs and
// query loads per (key, head) of the 8-lane loops.
#pragma once

#include <cstdint>

#include "cpu/tiles.h"

#if defined(__AVX512FP16__)
#include <immintrin.h>

namespace mlx_batched_decode::cpu {

inline __m512 load16(const float* p) {
  return _mm512_loadu_ps(p);
}

inline __m512 load16(const mx::float16_t* p) {
  return _mm512_cvtxph_ps(_mm256_loadu_ph(p));
}

// As in_register (vector_math.h): one load per use, not one folded into each FMA.
inline __m512 in_register16(__m512 v) {
  asm("" : "+v"(v));
  return v;
}

// The four horizontal sums of v[0..3]: halves added, then sum8x4.
inline void sum16x4(const __m512* v, float* out) {
  f32x8 half[4];
  for (int c = 0; c < 4; ++c) {
    half[c] = _mm512_castps512_ps256(v[c]) +
        _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v[c]), 1));
  }
  sum8x4(half, out);
}

// dot_4_rows on 16 lanes: out[h * out_stride + c] = dot(q + h * Dn, rows[c])
// for h < H (up to 4: 4H accumulators, 4 keys and a query fit the 32
// registers), c < 4; Dn is D or `dim`, multiples of 16.
template <int D, int H, typename T>
inline void dot_4_rows16(const float* q, const T* const* rows, float* out, int out_stride, int dim, Lookahead ahead = {}) {
  static_assert(D % 16 == 0, "fast head dims are multiples of 16");
  const int Dn = D ? D : dim;
  const T* r[4] = {rows[0], rows[1], rows[2], rows[3]};
  __m512 s[H][4];
  for (int h = 0; h < H; ++h) {
    for (int c = 0; c < 4; ++c) {
      s[h][c] = _mm512_setzero_ps();
    }
  }
  for (int i = 0; i < Dn; i += 16) {
    __m512 k[4];
    for (int c = 0; c < 4; ++c) {
      prefetch_successor(r[c], i, c, ahead);
      k[c] = in_register16(load16(r[c] + i));
    }
    for (int h = 0; h < H; ++h) {
      const __m512 qh = in_register16(_mm512_loadu_ps(q + h * Dn + i));
      for (int c = 0; c < 4; ++c) {
        s[h][c] = _mm512_fmadd_ps(qh, k[c], s[h][c]);
      }
    }
  }
  for (int h = 0; h < H; ++h) {
    sum16x4(s[h], out + h * out_stride);
  }
}

// 16-lane vectors per slice of accumulate_rows16: up to 16 accumulators for
// H rows, a divisor of the D / 16 vectors. The generic kernel: one.
constexpr int slice_vectors16(int D, int H) {
  if (D == 0) {
    return 1;
  }
  for (int w = 16 / H; w > 1; --w) {
    if ((D / 16) % w == 0) {
      return w;
    }
  }
  return 1;
}

// accumulate_rows on 16 lanes: acc[h] = alpha[h] * acc[h] + sum_j
// w[h * w_stride + j] * rows[j] for h < H, j < n, acc [H, Dn]; Masked as there.
template <int D, int H, bool Masked, typename T>
inline void accumulate_rows16(
    float* acc,
    const float* alpha,
    const float* w,
    int w_stride,
    const T* const* rows,
    int n,
    int dim,
    const uint32_t* masks,
    Lookahead ahead = {}) {
  constexpr int W = slice_vectors16(D, H);
  const int Dn = D ? D : dim;
  for (int i = 0; i < Dn; i += 16 * W) {
    __m512 a[H][W];
    for (int h = 0; h < H; ++h) {
      const __m512 scale = _mm512_set1_ps(alpha[h]);
      for (int c = 0; c < W; ++c) {
        a[h][c] = _mm512_mul_ps(_mm512_loadu_ps(acc + h * Dn + i + 16 * c), scale);
      }
    }
    for (int j = 0; j < n; ++j) {
      __m512 v[W];
      for (int c = 0; c < W; ++c) {
        prefetch_successor(rows[j], i + 16 * c, j, ahead);
        v[c] = in_register16(load16(rows[j] + i + 16 * c));
      }
      for (int h = 0; h < H; ++h) {
        if constexpr (Masked) {
          if (!(masks[h] >> j & 1u)) {
            continue;
          }
        }
        const __m512 wh = _mm512_set1_ps(w[h * w_stride + j]);
        for (int c = 0; c < W; ++c) {
          a[h][c] = _mm512_fmadd_ps(wh, v[c], a[h][c]);
        }
      }
    }
    for (int h = 0; h < H; ++h) {
      for (int c = 0; c < W; ++c) {
        _mm512_storeu_ps(acc + h * Dn + i + 16 * c, a[h][c]);
      }
    }
  }
}

} // namespace mlx_batched_decode::cpu
#endif
