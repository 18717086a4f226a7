// The two inner loops of the kernel on quantized rows (mx.quantize's affine
// format: per group of g elements a scale s and a bias b, element = s * w + b
// for its unsigned integer w): scores against the integers directly and the
// weighted sum of value rows. The integers are widened to float32 in
// registers; no row is dequantized to memory.
//
// Generic vector code: with 8 lanes where AVX-512 is missing, else 16.
#pragma once

#include <cstdint>
#include <cstring>

#include "cpu/tiles.h"
#include "cpu/vector_math.h"

namespace mlx_batched_decode::cpu {

// The loops' float32 vector: 16 lanes where AVX-512 has them (half the
// instructions per element: these loops are bound by arithmetic, not
// memory), else f32x8.
#if defined(__AVX512F__)
typedef float qvec __attribute__((vector_size(64)));
#else
typedef f32x8 qvec;
#endif
inline constexpr int kLanes = sizeof(qvec) / sizeof(float);

inline qvec qload(const float* p) {
  qvec v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}

inline void qstore(float* p, qvec v) {
  std::memcpy(p, &v, sizeof(v));
}

// A loop over the lanes compiles to one masked broadcast per lane.
inline qvec qsplat(float s) {
#if defined(__AVX512F__)
  return (qvec)_mm512_set1_ps(s);
#else
  return splat(s);
#endif
}

inline float qreduce(qvec v) {
#if defined(__AVX512F__)
  return _mm512_reduce_add_ps((__m512)v);
#else
  return sum8(v);
#endif
}

// Returns v, loaded into a register once (see in_register).
inline qvec qregister(qvec v) {
#if defined(__AVX512F__)
  asm("" : "+v"(v));
#elif defined(__AVX__)
  asm("" : "+x"(v));
#endif
  return v;
}

// Key rows one score tile of up to 4 query rows reads: 2 where AVX-512's 32
// registers hold the tile's 4 x 2 group sums and 4 x 2 totals, else 1. Each
// widened chunk of a key then serves all 4 rows.
#if defined(__AVX512F__)
inline constexpr int kQuantKeys = 2;
#else
inline constexpr int kQuantKeys = 1;
#endif

// Elements i .. i + kLanes - 1 (i a multiple of kLanes) of a row of
// Bits-wide integers packed into uint32 words, least significant first, as
// float32.
template <int Bits>
inline qvec widen(const uint32_t* row, int i) {
  static_assert(Bits == 4 || Bits == 8);
  const uint8_t* bytes = reinterpret_cast<const uint8_t*>(row) + static_cast<unsigned>(i) * Bits / 8;
#if defined(__AVX512F__)
  if constexpr (Bits == 8) {
    return (qvec)_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(bytes))));
  } else {
    // Each byte twice, then its low nibble in even lanes and its high one in odd lanes.
    const __m128i twice = _mm_unpacklo_epi8(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(bytes)),
                                            _mm_loadl_epi64(reinterpret_cast<const __m128i*>(bytes)));
    const __m512i shifts = _mm512_set_epi32(4, 0, 4, 0, 4, 0, 4, 0, 4, 0, 4, 0, 4, 0, 4, 0);
    const __m512i nibbles = _mm512_and_si512(_mm512_srlv_epi32(_mm512_cvtepu8_epi32(twice), shifts),
                                             _mm512_set1_epi32(15));
    return (qvec)_mm512_cvtepi32_ps(nibbles);
  }
#elif defined(__AVX2__)
  if constexpr (Bits == 8) {
    // GCC lowers the generic widening of 8 bytes to scalar inserts.
    return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(bytes))));
  } else {
    uint32_t w;
    std::memcpy(&w, bytes, sizeof(w));
    const __m256i nibbles = _mm256_and_si256(
        _mm256_srlv_epi32(_mm256_set1_epi32(static_cast<int>(w)), _mm256_setr_epi32(0, 4, 8, 12, 16, 20, 24, 28)),
        _mm256_set1_epi32(15));
    return _mm256_cvtepi32_ps(nibbles);
  }
#else
  qvec v;
  for (int e = 0; e < kLanes; ++e) {
    v[e] = static_cast<float>(Bits == 8 ? bytes[e] : (bytes[e / 2] >> (4 * (e % 2))) & 15);
  }
  return v;
#endif
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
  qvec total[H][C] = {};
  float bias[H][C] = {};
  for (int g = 0; g < groups; ++g) {
    qvec s[H][C] = {};
    for (int i = g * group_size; i < (g + 1) * group_size; i += kLanes) {
      qvec k[C];
      for (int c = 0; c < C; ++c) {
        k[c] = widen<Bits>(rows[c], i);
      }
      for (int h = 0; h < H; ++h) {
        const qvec qh = qregister(qload(q + h * Dn + i));
        for (int c = 0; c < C; ++c) {
          s[h][c] += qh * k[c];
        }
      }
    }
    for (int c = 0; c < C; ++c) {
      const qvec sc = qsplat(scales[g * sb_stride + c]);
      const float bc = biases[g * sb_stride + c];
      for (int h = 0; h < H; ++h) {
        total[h][c] += s[h][c] * sc;
        bias[h][c] += bc * qsum[h * groups + g];
      }
    }
  }
  for (int h = 0; h < H; ++h) {
    for (int c = 0; c < C; ++c) {
      out[h * out_stride + c] = qreduce(total[h][c]) + bias[h][c];
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
// row j joins acc[h] only where bit j of masks[h] is set. The first slice
// requests the lines of each row's successor (words per row), see Lookahead.
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
    const uint32_t* masks,
    int words,
    Lookahead ahead) {
  // Vectors per slice: at most 32 elements, and dividing the row.
  constexpr int W = kLanes == 16 ? 2 : (slice_vectors<8>(D, H) < 4 ? slice_vectors<8>(D, H) : 4);
  const int Dn = D ? D : dim;
  const int groups = Dn / group_size;
  for (int i = 0; i < Dn; i += kLanes * W) {
    const int g = i / group_size;
    qvec a[H][W];
    for (int h = 0; h < H; ++h) {
      const qvec bias = qsplat(bias_sum[h * groups + g]);
      for (int c = 0; c < W; ++c) {
        a[h][c] = qload(acc + h * Dn + i + kLanes * c) * alpha[h] + bias;
      }
    }
    for (int j = 0; j < n; ++j) {
      if (i == 0 && j < ahead.rows) {
        for (int byte = 0; byte < words * 4; byte += 64) {
          __builtin_prefetch(reinterpret_cast<const char*>(rows[j] + ahead.offset) + byte, 0, 1);
        }
      }
      qvec v[W];
      for (int c = 0; c < W; ++c) {
        v[c] = widen<Bits>(rows[j], i + kLanes * c);
      }
      for (int h = 0; h < H; ++h) {
        if constexpr (Masked) {
          if (!(masks[h] >> j & 1u)) {
            continue;
          }
        }
        const qvec wh = qsplat(ws[(h * groups + g) * ws_stride + j]);
        for (int c = 0; c < W; ++c) {
          a[h][c] += wh * v[c];
        }
      }
    }
    for (int h = 0; h < H; ++h) {
      for (int c = 0; c < W; ++c) {
        qstore(acc + h * Dn + i + kLanes * c, a[h][c]);
      }
    }
  }
}

} // namespace mlx_batched_decode::cpu
