// The two inner loops of the kernel on quantized rows (mx.quantize's affine
// format: per group of g elements a scale s and a bias b, element = s * w + b
// for its unsigned integer w): scores against the integers directly and the
// weighted sum of value rows. The integers are widened to float32 in
// registers; no row is dequantized to memory.
#pragma once

#include <cstdint>
#include <cstring>

#include "cpu/tiles.h"
#include "cpu/vector_math.h"

namespace mlx_batched_decode::cpu {

// Key rows one score tile reads: 4 where AVX-512VL's 32 registers hold the
// tile's 2 x 4 group sums and 2 x 4 totals, else 2.
#if defined(__AVX512VL__)
inline constexpr int kQuantKeys = 4;
#else
inline constexpr int kQuantKeys = 2;
#endif

// Elements i .. i + 7 (i a multiple of 8) of a row of Bits-wide integers
// packed into uint32 words, least significant first, as float32.
template <int Bits>
inline f32x8 widen8(const uint32_t* row, int i) {
  static_assert(Bits == 4 || Bits == 8);
  typedef uint32_t u32x8 __attribute__((vector_size(32)));
  if constexpr (Bits == 8) {
    typedef uint8_t u8x8 __attribute__((vector_size(8)));
    u8x8 bytes;
    std::memcpy(&bytes, reinterpret_cast<const uint8_t*>(row) + i, sizeof(bytes));
    return __builtin_convertvector(__builtin_convertvector(bytes, i32x8), f32x8);
  } else {
    const uint32_t w = row[i / 8];
    const u32x8 nibbles = (u32x8{w, w, w, w, w, w, w, w} >> u32x8{0, 4, 8, 12, 16, 20, 24, 28}) & 15u;
    return __builtin_convertvector((i32x8)nibbles, f32x8);
  }
}

// Scores of a tile of H query rows against C key rows of integers:
// out[h * out_stride + c] = sum over groups g of
//   scales[g * sb_stride + c] * dot(q_hg, w_cg) + biases[g * sb_stride + c] * qsum[h * groups + g],
// q [H, Dn] scaled queries, qsum [H, groups] their sums per group, Dn = D or
// dim for the generic kernel (D == 0), groups of group_size elements. Each
// widened chunk of a key serves the H rows; a group's dot products are scaled
// once, when the group ends.
template <int Bits, int D, int H, int C>
inline void dot_rows_quantized(
    const float* q,
    const float* qsum,
    const uint32_t* const* rows,
    const float* scales,
    const float* biases,
    int sb_stride,
    float* out,
    int out_stride,
    int dim,
    int group_size) {
  const int Dn = D ? D : dim;
  const int groups = Dn / group_size;
  f32x8 total[H][C] = {};
  float bias[H][C] = {};
  for (int g = 0; g < groups; ++g) {
    f32x8 s[H][C] = {};
    for (int i = g * group_size; i < (g + 1) * group_size; i += 8) {
      f32x8 k[C];
      for (int c = 0; c < C; ++c) {
        k[c] = widen8<Bits>(rows[c], i);
      }
      for (int h = 0; h < H; ++h) {
        const f32x8 qh = in_register(load8(q + h * Dn + i));
        for (int c = 0; c < C; ++c) {
          s[h][c] += qh * k[c];
        }
      }
    }
    for (int c = 0; c < C; ++c) {
      const f32x8 sc = splat(scales[g * sb_stride + c]);
      const float bc = biases[g * sb_stride + c];
      for (int h = 0; h < H; ++h) {
        total[h][c] += s[h][c] * sc;
        bias[h][c] += bc * qsum[h * groups + g];
      }
    }
  }
  for (int h = 0; h < H; ++h) {
    for (int c = 0; c < C; ++c) {
      out[h * out_stride + c] = sum8(total[h][c]) + bias[h][c];
    }
  }
}

// Weighted value rows of integers into the rescaled accumulators of a tile of
// H query rows: acc[h] = alpha[h] * acc[h] + bias_sum[h * groups + g] +
// sum_j ws[(h * groups + g) * ws_stride + j] * w_j, element by element, g the
// group of the element, j < n, where ws holds each row's softmax weight times
// the row's scale of the group and bias_sum the weighted biases of the group.
// As accumulate_rows, a slice of acc stays in registers over all n rows;
// slices are at most 32 elements, so that each lies in one group. Masked:
// row j joins acc[h] only where bit j of masks[h] is set.
template <int Bits, int D, int H, bool Masked>
inline void accumulate_rows_quantized(
    float* acc,
    const float* alpha,
    const float* ws,
    int ws_stride,
    const float* bias_sum,
    const uint32_t* const* rows,
    int n,
    int dim,
    int group_size,
    const uint32_t* masks) {
  constexpr int W = slice_vectors(D, H) < 4 ? slice_vectors(D, H) : 4;
  const int Dn = D ? D : dim;
  const int groups = Dn / group_size;
  for (int i = 0; i < Dn; i += 8 * W) {
    const int g = i / group_size;
    f32x8 a[H][W];
    for (int h = 0; h < H; ++h) {
      const f32x8 bias = splat(bias_sum[h * groups + g]);
      for (int c = 0; c < W; ++c) {
        a[h][c] = load8(acc + h * Dn + i + 8 * c) * alpha[h] + bias;
      }
    }
    for (int j = 0; j < n; ++j) {
      f32x8 v[W];
      for (int c = 0; c < W; ++c) {
        v[c] = widen8<Bits>(rows[j], i + 8 * c);
      }
      for (int h = 0; h < H; ++h) {
        if constexpr (Masked) {
          if (!(masks[h] >> j & 1u)) {
            continue;
          }
        }
        const f32x8 wh = splat(ws[(h * groups + g) * ws_stride + j]);
        for (int c = 0; c < W; ++c) {
          a[h][c] += wh * v[c];
        }
      }
    }
    for (int h = 0; h < H; ++h) {
      for (int c = 0; c < W; ++c) {
        store8(acc + h * Dn + i + 8 * c, a[h][c]);
      }
    }
  }
}

} // namespace mlx_batched_decode::cpu
