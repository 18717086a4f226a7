// The two inner loops of the kernel, on tiles of query heads and key rows:
// scores (Q K^T) and the weighted sum of value rows (P V), written once for
// every lane width (lanes.h). Rows are read in place as float32, float16 or
// bfloat16 and widened in registers.
#pragma once

#include <algorithm>
#include <cstdint>

#include "cpu/lanes.h"
#include "cpu/prefetch.h"

namespace mlx_batched_decode::cpu::MBD_CPU_ISA {

// The rows to request from memory while a tile runs: row j of the tile has a
// successor `offset` elements further on (offsets[j] when offsets is set: a
// paged source's next rows lie on other pages) for j < rows. The requests are
// spread over the tile's loop, one cache line at a time, because a burst of
// them stalls on the core's few miss buffers.
struct Lookahead {
  int64_t offset = 0;
  int rows = 0;
  const int64_t* offsets = nullptr;
};

// Elements of T in a 64-byte cache line: the unit a row's successor is
// requested in.
template <typename T>
constexpr int kLineElements = 64 / static_cast<int>(sizeof(T));

// The successor of row j (rows[j] + its offset), or null past ahead.rows.
template <typename T>
inline const T* successor(const T* row, int j, Lookahead ahead) {
  return j < ahead.rows ? row + (ahead.offsets ? ahead.offsets[j] : ahead.offset) : nullptr;
}

// Requests, into L2, the line of a successor row that holds element i.
template <typename T>
inline void prefetch_line(const T* next, int i) {
  if (next != nullptr) {
    prefetch_l2(next + i);
  }
}

// Scores of a tile of H query rows against four rows of T on lanes L:
// out[h * out_stride + c] = dot(q + h * Dn, rows[c]) for h < H, c < 4, where
// Dn is D, or `dim` (a multiple of L::kStep) for the generic kernel (D == 0);
// q holds float32 rows scaled already, or, for lanes whose queries stay raw
// (L::kRawQueries: Bf16Pairs' bfloat16 rows), unscaled ones whose scores are
// multiplied by `scale` here. Each row chunk loaded
// once serves H query rows, and the 4H independent accumulator chains hide
// the FMA latency a single dot is bound by (4H accumulators and 4 chunks of
// keys must fit the registers: H <= 2 on 8 lanes without AVX-512VL's 32).
template <typename L, int D, int H, typename Q, typename T>
inline void dot_4_rows(const Q* q, const T* const* rows, float* out, int out_stride, int dim, Lookahead ahead = {},
                       float scale = 1.0f) {
  static_assert(D % L::kStep == 0, "head dims are multiples of the chunk");
  constexpr int kLine = kLineElements<T>, kChunks = kLine / L::kStep;
  static_assert(kChunks >= 1 && kLine % L::kStep == 0, "a chunk lies within one cache line");
  const int Dn = D ? D : dim;
  const T* r[4] = {rows[0], rows[1], rows[2], rows[3]};
  const T* next[4];
  typename L::Acc s[H][4];
  for (int c = 0; c < 4; ++c) {
    next[c] = successor(r[c], c, ahead);
    for (int h = 0; h < H; ++h) {
      s[h][c] = L::zero();
    }
  }
  // A line at a time, so that each successor line is requested without a test per chunk.
  for (int line = 0; line < Dn; line += kLine) {
    for (int c = 0; c < 4; ++c) {
      prefetch_line(next[c], line);
    }
#pragma GCC unroll 8
    for (int u = 0; u < kChunks; ++u) {
      const int i = line + u * L::kStep;
      if ((D == 0 || D % kLine != 0) && i >= Dn) {
        break;
      }
      typename L::Row k[4];
      for (int c = 0; c < 4; ++c) {
        k[c] = L::load(r[c] + i);
      }
      for (int h = 0; h < H; ++h) {
        const typename L::Row qh = L::load(q + h * Dn + i);
        for (int c = 0; c < 4; ++c) {
          s[h][c] = L::fma(qh, k[c], s[h][c]);
        }
      }
    }
  }
  for (int h = 0; h < H; ++h) {
    float* o = out + h * out_stride;
    L::sum4(s[h], o);
    if constexpr (L::kRawQueries) {
      for (int c = 0; c < 4; ++c) {
        o[c] *= scale;
      }
    }
  }
}

// A block's key rows of T widened to float32 and transposed, keys as lanes:
// kt[i * kBlockKeys + j] = rows[j][i] for i < Dn (D, or `dim` for the generic
// kernel), j < n; keys n .. kBlockKeys - 1 are zeros. Built once per block for
// the keys-major scores below, it serves every query row tile of the block.
// The block's successor rows are requested here, a line per row and line.
template <int D, int kBlockKeys, typename T>
inline void transpose_keys(const T* const* rows, int n, int dim, float* kt, Lookahead ahead) {
  const int Dn = D ? D : dim;
  for (int j = 0; j < kBlockKeys; ++j) {
    const T* next = j < n ? successor(rows[j], j, ahead) : nullptr;
    for (int i = 0; i < Dn; i += 8) {
      if (i % kLineElements<T> == 0) {
        prefetch_line(next, i);
      }
      const f32x8 v = j < n ? load8(rows[j] + i) : f32x8{};
      for (int e = 0; e < 8; ++e) {
        kt[(i + e) * kBlockKeys + j] = v[e];
      }
    }
  }
}

// Scores of a tile of H query rows (float32, scaled, Dn apart) against 16 keys
// of a transposed block (kt at their first column, kt_stride floats per
// dimension), on 8 lanes: out[h * out_stride + c] = dot(q + h * Dn, key c).
// Each dimension takes two key vectors and H broadcast query elements into 2H
// accumulators: at H = 6, 12 FMAs per 8 loads in 15 of the 16 registers, the
// blocking of a GEMM micro-kernel, with no horizontal sum at the end.
template <int D, int H>
inline void dot_keys_major(const float* q, const float* kt, int kt_stride, float* out, int out_stride, int dim) {
  const int Dn = D ? D : dim;
  f32x8 s[H][2];
  for (int h = 0; h < H; ++h) {
    s[h][0] = s[h][1] = f32x8{};
  }
#pragma GCC unroll 4
  for (int i = 0; i < Dn; ++i) {
    const f32x8 k0 = in_register(load8(kt + i * kt_stride)), k1 = in_register(load8(kt + i * kt_stride + 8));
    for (int h = 0; h < H; ++h) {
      const f32x8 qh = splat(q[h * Dn + i]);
      s[h][0] += qh * k0;
      s[h][1] += qh * k1;
    }
  }
  for (int h = 0; h < H; ++h) {
    store8(out + h * out_stride, s[h][0]);
    store8(out + h * out_stride + 8, s[h][1]);
  }
}

// Vectors of L per slice of accumulate_rows: as many as keep up to Lanes
// accumulators busy for H rows (8 chains cover the FMA latency), at least 2
// (a tile of 6 rows on 8 lanes: 12 accumulators, 2 values, 1 weight), and
// dividing the D / Lanes vectors. The generic kernel's padded dims are multiples of 16.
template <int Lanes>
constexpr int slice_vectors(int D, int H) {
  if (D == 0) {
    return 16 / Lanes;
  }
  for (int w = std::max(Lanes / H, 2); w > 1; --w) {
    if ((D / Lanes) % w == 0) {
      return w;
    }
  }
  return 1;
}

// Weighted rows of T into the rescaled accumulators of a tile of H query rows,
// on lanes L: acc[h] = alpha[h] * acc[h] + sum_j w[h * w_stride + j] * rows[j]
// for h < H, j < n, acc [H, Dn]. One slice of Dn at a time stays in registers
// over all n rows, so acc is loaded and stored once per call, not once per
// row, and the online softmax's rescale rides on that load. Masked: row j
// joins acc[h] only where bit j of masks[h] is set, so that a key outside a
// query row's range adds nothing, not 0 * NaN (blocks on the edge of a row's
// range only).
template <typename L, int D, int H, bool Masked, typename T>
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
  constexpr int V = L::kStep, W = slice_vectors<V>(D, H), kLine = kLineElements<T>;
  static_assert(kLine % V == 0, "a chunk lies within one cache line");
  const int Dn = D ? D : dim;
  // Slices of whole lines start lines at the same chunks, known at compile time.
  constexpr bool kWholeLines = (V * W) % kLine == 0;
  const T* next[32]; // n <= 32, the bits of a mask
  for (int j = 0; j < n; ++j) {
    next[j] = successor(rows[j], j, ahead);
  }
  for (int i = 0; i < Dn; i += V * W) {
    typename L::Acc a[H][W];
    unsigned line_starts = 0; // bit c: chunk c of this slice starts a cache line
    for (int c = 0; c < W; ++c) {
      line_starts |= unsigned{((kWholeLines ? 0 : i) + V * c) % kLine == 0} << c;
    }
    for (int h = 0; h < H; ++h) {
      const typename L::Acc scale = L::splat(alpha[h]);
      for (int c = 0; c < W; ++c) {
        a[h][c] = L::mul(L::load_acc(acc + h * Dn + i + V * c), scale);
      }
    }
    for (int j = 0; j < n; ++j) {
      typename L::Row v[W];
      for (int c = 0; c < W; ++c) {
        if (line_starts >> c & 1u) {
          prefetch_line(next[j], i + V * c);
        }
        v[c] = L::load(rows[j] + i + V * c);
      }
      for (int h = 0; h < H; ++h) {
        if constexpr (Masked) {
          if (!(masks[h] >> j & 1u)) {
            continue;
          }
        }
        const typename L::Acc wh = L::splat(w[h * w_stride + j]);
        for (int c = 0; c < W; ++c) {
          a[h][c] = L::fma(wh, v[c], a[h][c]);
        }
      }
    }
    for (int h = 0; h < H; ++h) {
      for (int c = 0; c < W; ++c) {
        L::store(acc + h * Dn + i + V * c, a[h][c]);
      }
    }
  }
}

#if defined(__AVX512BF16__) && defined(__AVX512BW__)
// 32-dim chunks per slice of accumulate_pairs: up to 16 accumulators for H rows
// (two per chunk and row), dividing the D / 32 chunks.
constexpr int pair_slice_chunks(int D, int H) {
  for (int w = 4; w > 1; --w) {
    if ((D / 32) % w == 0 && 2 * H * w <= 16) {
      return w;
    }
  }
  return 1;
}

// accumulate_rows for bfloat16 value rows and weights w already rounded to
// bfloat16 (softmax_block<true>), unmasked, on the AVX512_BF16 dot product:
// two keys per instruction, each product exact and the sums float32, so one
// VDPBF16PS does the work of two FMAs and no row is widened. Rows j and j + 1
// are interleaved into (v_j[d], v_j+1[d]) pairs by VPUNPCK{L,H}WD, which
// works within 128-bit lanes: a 32-dim chunk's sums land in two accumulators,
// dims 8k .. 8k + 3 in `lo` and 8k + 4 .. 8k + 7 in `hi` (k = 0..3). The
// accumulators are permuted into that order once per slice and back on store.
// A last odd row is paired with zeros. n <= 32.
template <int D, int H>
inline void accumulate_pairs(float* acc, const float* alpha, const float* w, int w_stride,
                             const mx::bfloat16_t* const* rows, int n, Lookahead ahead = {}) {
  static_assert(D > 0 && D % 32 == 0, "whole 32-dim chunks");
  constexpr int W = pair_slice_chunks(D, H);
  // Weights of keys 2p and 2p + 1 as one bfloat16 pair: pairs[h][p]. Exact, as
  // w is rounded already; lanes past n are 0 and never read past n + 1.
  alignas(64) uint32_t pairs[H][16];
  for (int h = 0; h < H; ++h) {
    const __m512bh b = _mm512_cvtne2ps_pbh(_mm512_loadu_ps(w + h * w_stride + 16), _mm512_loadu_ps(w + h * w_stride));
    _mm512_store_si512(pairs[h], (__m512i)(b));
  }
  // Natural dims 0..15 (first) and 16..31 (second) <-> the lo / hi order.
  const __m512i to_lo = _mm512_setr_epi32(0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27);
  const __m512i to_hi = _mm512_add_epi32(to_lo, _mm512_set1_epi32(4));
  const __m512i to_first = _mm512_setr_epi32(0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23);
  const __m512i to_second = _mm512_add_epi32(to_first, _mm512_set1_epi32(8));
  const mx::bfloat16_t* next[32];
  for (int j = 0; j < n; ++j) {
    next[j] = successor(rows[j], j, ahead);
  }
  for (int i = 0; i < D; i += 32 * W) {
    __m512 lo[H][W], hi[H][W];
    for (int h = 0; h < H; ++h) {
      const __m512 scale = _mm512_set1_ps(alpha[h]);
      for (int c = 0; c < W; ++c) {
        const float* a = acc + h * D + i + 32 * c;
        const __m512 first = _mm512_loadu_ps(a), second = _mm512_loadu_ps(a + 16);
        lo[h][c] = _mm512_mul_ps(_mm512_permutex2var_ps(first, to_lo, second), scale);
        hi[h][c] = _mm512_mul_ps(_mm512_permutex2var_ps(first, to_hi, second), scale);
      }
    }
    for (int j = 0; j < n; j += 2) {
      const bool odd = j + 1 == n;
      __m512i pl[W], ph[W];
      for (int c = 0; c < W; ++c) {
        prefetch_line(next[j], i + 32 * c);
        const __m512i a = _mm512_loadu_si512(rows[j] + i + 32 * c);
        __m512i b = _mm512_setzero_si512();
        if (!odd) {
          prefetch_line(next[j + 1], i + 32 * c);
          b = _mm512_loadu_si512(rows[j + 1] + i + 32 * c);
        }
        pl[c] = _mm512_unpacklo_epi16(a, b);
        ph[c] = _mm512_unpackhi_epi16(a, b);
      }
      for (int h = 0; h < H; ++h) {
        const __m512bh wh = (__m512bh)(_mm512_set1_epi32(static_cast<int>(pairs[h][j / 2])));
        for (int c = 0; c < W; ++c) {
          lo[h][c] = _mm512_dpbf16_ps(lo[h][c], (__m512bh)(pl[c]), wh);
          hi[h][c] = _mm512_dpbf16_ps(hi[h][c], (__m512bh)(ph[c]), wh);
        }
      }
    }
    for (int h = 0; h < H; ++h) {
      for (int c = 0; c < W; ++c) {
        float* a = acc + h * D + i + 32 * c;
        _mm512_storeu_ps(a, _mm512_permutex2var_ps(lo[h][c], to_first, hi[h][c]));
        _mm512_storeu_ps(a + 16, _mm512_permutex2var_ps(lo[h][c], to_second, hi[h][c]));
      }
    }
  }
}
#endif

} // namespace mlx_batched_decode::cpu::MBD_CPU_ISA
