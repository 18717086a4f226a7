// Small float32 vector kernels, vectorised for whatever SIMD ISA the including
// translation unit is compiled for.
#pragma once

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

// Scores of a tile of H query heads against a block of rows:
// out[h * out_stride + j] = dot(q + h * D, rows[j]) for h < H, j < n.
// Four rows at a time: each row chunk loaded once serves H heads, and the 4H
// independent accumulator chains hide the FMA latency a single dot is bound by.
template <int D, int H>
inline void dot_rows(const float* q, const float* const* rows, int n, float* out, int out_stride) {
  static_assert(D % 8 == 0, "head dims are multiples of 8");
  int j = 0;
  for (; j + 4 <= n; j += 4) {
    const float* r[4] = {rows[j], rows[j + 1], rows[j + 2], rows[j + 3]};
    f32x8 s[H][4] = {};
    for (int i = 0; i < D; i += 8) {
      f32x8 k[4];
      for (int c = 0; c < 4; ++c) {
        k[c] = load8(r[c] + i);
      }
      for (int h = 0; h < H; ++h) {
        const f32x8 qh = load8(q + h * D + i);
        for (int c = 0; c < 4; ++c) {
          s[h][c] += qh * k[c];
        }
      }
    }
    for (int h = 0; h < H; ++h) {
      for (int c = 0; c < 4; ++c) {
        out[h * out_stride + j + c] = sum8(s[h][c]);
      }
    }
  }
  for (; j < n; ++j) {
    f32x8 s[H] = {};
    for (int i = 0; i < D; i += 8) {
      const f32x8 k = load8(rows[j] + i);
      for (int h = 0; h < H; ++h) {
        s[h] += load8(q + h * D + i) * k;
      }
    }
    for (int h = 0; h < H; ++h) {
      out[h * out_stride + j] = sum8(s[h]);
    }
  }
}

// Weighted rows into the accumulators of a tile of H heads:
// acc[h] += sum_j w[h * w_stride + j] * rows[j] for h < H, j < n, with
// acc [H, D]. Four rows per pass, each chunk loaded once for all H heads.
template <int D, int H>
inline void accumulate_rows(float* acc, const float* w, int w_stride, const float* const* rows, int n) {
  int j = 0;
  for (; j + 4 <= n; j += 4) {
    // Locals, so stores to acc cannot force the row pointers to be reloaded.
    const float* r[4] = {rows[j], rows[j + 1], rows[j + 2], rows[j + 3]};
    float wt[H][4];
    for (int h = 0; h < H; ++h) {
      for (int c = 0; c < 4; ++c) {
        wt[h][c] = w[h * w_stride + j + c];
      }
    }
    for (int i = 0; i < D; i += 8) {
      f32x8 k[4];
      for (int c = 0; c < 4; ++c) {
        k[c] = load8(r[c] + i);
      }
      for (int h = 0; h < H; ++h) {
        f32x8 a = load8(acc + h * D + i);
        a += wt[h][0] * k[0] + wt[h][1] * k[1];
        a += wt[h][2] * k[2] + wt[h][3] * k[3];
        store8(acc + h * D + i, a);
      }
    }
  }
  for (; j < n; ++j) {
    for (int i = 0; i < D; i += 8) {
      const f32x8 k = load8(rows[j] + i);
      for (int h = 0; h < H; ++h) {
        store8(acc + h * D + i, load8(acc + h * D + i) + w[h * w_stride + j] * k);
      }
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
