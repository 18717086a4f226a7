// The two inner loops of the kernel, on tiles of query heads and key rows:
// scores (Q K^T) and the weighted sum of value rows (P V). Rows are read in
// place as float32, float16 or bfloat16 and widened in registers.
#pragma once

#include <cstdint>

#include "cpu/convert.h"
#include "cpu/vector_math.h"

#if defined(__AVX__)
#include <immintrin.h>
#endif

namespace mlx_batched_decode::cpu {

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

// The rows to request from memory while a tile runs: row j of the tile has a
// successor `offset` elements further on (offsets[j] when offsets is set: a
// paged source's next rows lie on other pages) for j < rows. The requests are
// spread over the tile's loop, one cache line per chunk, because a burst of
// them stalls on the core's few miss buffers.
struct Lookahead {
  int64_t offset = 0;
  int rows = 0;
  const int64_t* offsets = nullptr;
};

// Requests, into L2, the line of row j's successor that holds element i, once
// per line: on the chunk that starts it.
template <typename T>
inline void prefetch_successor(const T* row, int i, int j, Lookahead ahead) {
  if (j < ahead.rows && (i * sizeof(T)) % 64 == 0) {
    __builtin_prefetch(row + (ahead.offsets ? ahead.offsets[j] : ahead.offset) + i, 0, 1);
  }
}

// Scores of a tile of H query rows against four rows of T (float32, or a
// 16-bit type with a load8 overload that widens it):
// out[h * out_stride + c] = dot(q + h * Dn, rows[c]) for h < H, c < 4, where
// Dn is D, or `dim` (a multiple of 8) for the generic kernel (D == 0).
// Each row chunk loaded once serves H query rows, and the 4H independent
// accumulator chains hide the FMA latency a single dot is bound by.
template <int D, int H, typename T>
inline void dot_4_rows(const float* q, const T* const* rows, float* out, int out_stride, int dim, Lookahead ahead = {}) {
  static_assert(D % 8 == 0, "head dims are multiples of 8");
  const int Dn = D ? D : dim;
  const T* r[4] = {rows[0], rows[1], rows[2], rows[3]};
  f32x8 s[H][4] = {};
  for (int i = 0; i < Dn; i += 8) {
    f32x8 k[4];
    for (int c = 0; c < 4; ++c) {
      prefetch_successor(r[c], i, c, ahead);
      k[c] = in_register(load8(r[c] + i));
    }
    for (int h = 0; h < H; ++h) {
      const f32x8 qh = in_register(load8(q + h * Dn + i));
      for (int c = 0; c < 4; ++c) {
        s[h][c] += qh * k[c];
      }
    }
  }
  for (int h = 0; h < H; ++h) {
    sum8x4(s[h], out + h * out_stride);
  }
}

#if defined(__AVX512BF16__) && defined(__AVX512VL__)
// dot_4_rows for bfloat16 rows and unscaled bfloat16 queries q [H, Dn], with
// the AVX512_BF16 dot product: each instruction multiplies 16 pairs exactly
// and adds them into 8 float32 lanes, so keys are not widened and the score
// FMAs halve. out[h * out_stride + c] = scale * dot(q + h * Dn, rows[c]).
// 4H accumulators and 4 rows of keys need the 32 registers of AVX-512VL.
template <int D, int H>
inline void dot_4_rows_bf16(
    const mx::bfloat16_t* q,
    const mx::bfloat16_t* const* rows,
    float* out,
    int out_stride,
    int dim,
    float scale,
    Lookahead ahead = {}) {
  static_assert(D % 16 == 0, "head dims are multiples of 16");
  const int Dn = D ? D : dim;
  const mx::bfloat16_t* r[4] = {rows[0], rows[1], rows[2], rows[3]};
  f32x8 s[H][4] = {};
  for (int i = 0; i < Dn; i += 16) {
    __m256bh k[4];
    for (int c = 0; c < 4; ++c) {
      prefetch_successor(r[c], i, c, ahead);
      k[c] = (__m256bh)_mm256_loadu_si256(reinterpret_cast<const __m256i*>(r[c] + i));
    }
    for (int h = 0; h < H; ++h) {
      const auto qh = (__m256bh)_mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + h * Dn + i));
      for (int c = 0; c < 4; ++c) {
        s[h][c] = _mm256_dpbf16_ps(s[h][c], qh, k[c]);
      }
    }
  }
  for (int h = 0; h < H; ++h) {
    float* o = out + h * out_stride;
    sum8x4(s[h], o);
    for (int c = 0; c < 4; ++c) {
      o[c] *= scale;
    }
  }
}
#endif

// Vectors per slice of accumulate_rows: as many as keep 8 accumulators busy
// for H rows (8 chains cover the FMA latency) and divide the D / 8 vectors.
// The generic kernel's padded dims are multiples of 16: two vectors.
constexpr int slice_vectors(int D, int H) {
  if (D == 0) {
    return 2;
  }
  for (int w = 8 / H; w > 1; --w) {
    if ((D / 8) % w == 0) {
      return w;
    }
  }
  return 1;
}

// Weighted rows of T into the rescaled accumulators of a tile of H query rows:
// acc[h] = alpha[h] * acc[h] + sum_j w[h * w_stride + j] * rows[j] for h < H,
// j < n, acc [H, Dn]. One slice of Dn at a time stays in registers over all n
// rows, so acc is loaded and stored once per call, not once per row, and the
// online softmax's rescale rides on that load. Masked: row j joins acc[h]
// only where bit j of masks[h] is set, so that a key outside a query row's
// range adds nothing, not 0 * NaN (blocks on the edge of a row's range only).
template <int D, int H, bool Masked, typename T>
inline void accumulate_rows(
    float* acc,
    const float* alpha,
    const float* w,
    int w_stride,
    const T* const* rows,
    int n,
    int dim,
    const uint32_t* masks,
    Lookahead ahead = {}) {
  constexpr int W = slice_vectors(D, H);
  const int Dn = D ? D : dim;
  for (int i = 0; i < Dn; i += 8 * W) {
    f32x8 a[H][W];
    for (int h = 0; h < H; ++h) {
      for (int c = 0; c < W; ++c) {
        a[h][c] = load8(acc + h * Dn + i + 8 * c) * alpha[h];
      }
    }
    for (int j = 0; j < n; ++j) {
      f32x8 v[W];
      for (int c = 0; c < W; ++c) {
        prefetch_successor(rows[j], i + 8 * c, j, ahead);
        v[c] = in_register(load8(rows[j] + i + 8 * c));
      }
      for (int h = 0; h < H; ++h) {
        if constexpr (Masked) {
          if (!(masks[h] >> j & 1u)) {
            continue;
          }
        }
        const f32x8 wh = splat(w[h * w_stride + j]);
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
