// The block step of the CPU kernel on AMX tiles (Intel Advanced Matrix
// Extensions, Sapphire Rapids and later) for float16 and bfloat16 keys and
// values: the arithmetic of the R = G * L query rows of a work item against a
// block of 32 keys runs as bfloat16 tile dot products with float32
// accumulation: one does 16 x 16 x 32 multiply-adds where an AVX-512 FMA does
// 16, so many query rows cost far less than on the vector path.
//
// Accuracy: a value v is split into bfloat16 parts hi (v's top 16 bits) and
// lo (bf16 of v - hi). For float16 values and queries (11 significant bits)
// the split is exact; bfloat16 needs no lo part. Each tile product of two
// bfloat16 values is exact in float32, and products accumulate in float32.
// Softmax weights p (float32) are split the same way, exact to 16 bits; the
// scores' scale is applied in float32. The product of two lo parts (under
// 2^-16 of the product, 1/32 of a float16 output's rounding) is left out.
// A tile product cannot skip an inf or NaN (0 * inf is NaN), so a block whose
// split values hold one is left to the vector path, which keeps each query
// row's result independent of the keys outside its range.
//
// Layouts (all tiles 16 rows x 64 bytes):
//   scores  S^T [32 keys, 16 rows] = K [32 keys, Dq] . Q^T, Q^T in pairs of d
//   values  O [16 rows, 16 d] += P [16 rows, 32 keys] . V, V in pairs of keys
// with S^T's lanes the query rows, so the online softmax runs on 16 rows at once.
#pragma once

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__)

#include <immintrin.h>

#include <bit>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#include "cpu/cache_lines.h"
#include "cpu/decode_args.h"
#include "cpu/prefetch.h"
#include "cpu/vector_math.h"
#include "mlx/types/half_types.h"

namespace mlx_batched_decode::cpu::MBD_CPU_ISA::amx {

namespace mx = mlx::core;

// Query rows per tile (a row group) and keys per block.
constexpr int kRows = 16;
constexpr int kKeys = 32;

// Tile registers are named by literals (GCC's tile intrinsics paste their
// number into the instruction): 0 and 1 accumulate (scores of keys 0-15 and
// 16-31, then two P . V products), 2/3 and 6/7 hold hi/lo left operands,
// 4/5 hi/lo right operands.

// The tile configuration ldtilecfg reads: palette 1, every tile 16 rows x 64
// bytes. A constant in memory, not stores before the call: GCC's ldtilecfg
// builtin does not tell the optimiser that it reads them, and at -O3 they
// were dropped (tiles left unconfigured, SIGILL at the first tile instruction).
struct alignas(64) TileConfig {
  uint8_t palette, start_row, reserved[14];
  uint16_t colsb[16];
  uint8_t rows[16];
};
inline constexpr TileConfig kTileConfig = {
    1, 0, {}, {64, 64, 64, 64, 64, 64, 64, 64}, {16, 16, 16, 16, 16, 16, 16, 16}};

// Tile state is per thread and is released after each work item, so threads
// that run no AMX save none of it.
inline void configure() {
  _tile_loadconfig(&kTileConfig);
}

inline void release() {
  _tile_release();
}

// Requests the next block's rows from memory, one row of keys (then of
// values) per key of this block's softmax: a burst of requests stalls on the
// core's few miss buffers and the excess is dropped. Row j of the next block
// is `ahead` elements past row j of this one, for j < rows.
struct NextBlock {
  const char* first[2] = {}; // row 0 of the next block's keys and of its values
  int64_t stride[2] = {}; // bytes between rows
  int rows[2] = {};
  int per_row = 0; // cache lines of a row

  template <typename T>
  void set(int part, const T* row0, int64_t row_stride, int64_t ahead_elements, int n, int D) {
    first[part] = reinterpret_cast<const char*>(row0 + ahead_elements);
    stride[part] = row_stride * static_cast<int64_t>(sizeof(T));
    rows[part] = n;
    per_row = (D * static_cast<int>(sizeof(T)) + 63) / 64;
  }

  // Requests row j of the keys (part 0) or values (part 1), if the next block has it.
  void request(int part, int j) const {
    if (j < rows[part]) {
      for (int line = 0; line < per_row; ++line) {
        prefetch_l2(first[part] + j * stride[part] + line * 64);
      }
    }
  }
};

// Word indexes that pack the top halves (bfloat16 truncations) of the 16
// float32 of a, then of b.
inline __m512i top_halves() {
  return _mm512_set_epi32(
      0x003F003D, 0x003B0039, 0x00370035, 0x00330031, 0x002F002D, 0x002B0029, 0x00270025, 0x00230021,
      0x001F001D, 0x001B0019, 0x00170015, 0x00130011, 0x000F000D, 0x000B0009, 0x00070005, 0x00030001);
}

// a minus its top 16 bits (its bfloat16 truncation): exact in float32.
inline __m512i rest(__m512 a) {
  const __m512i top = _mm512_set1_epi32(static_cast<int>(0xFFFF0000u));
  return _mm512_castps_si512(_mm512_sub_ps(a, _mm512_castsi512_ps(_mm512_and_si512(_mm512_castps_si512(a), top))));
}

// Splits float32 a and b into bfloat16 parts: hi their top 16 bits, lo the
// top 16 bits of the rest, the 32 words of each packed in `order`.
inline void split(__m512 a, __m512 b, __m512i order, __m512i& hi, __m512i& lo) {
  hi = _mm512_permutex2var_epi16(_mm512_castps_si512(a), order, _mm512_castps_si512(b));
  lo = _mm512_permutex2var_epi16(rest(a), order, rest(b));
}

// Splits as split does, interleaved: dword i of hi holds the top halves of
// a[i] (low word) and b[i] (high word), of lo those of the rests. A shift and
// a word blend each, where a vpermt2w is three uops.
inline void split_pairs(__m512 a, __m512 b, __m512i& hi, __m512i& lo) {
  const __mmask32 high_words = 0xAAAAAAAAu;
  hi = _mm512_mask_blend_epi16(high_words, _mm512_srli_epi32(_mm512_castps_si512(a), 16), _mm512_castps_si512(b));
  lo = _mm512_mask_blend_epi16(high_words, _mm512_srli_epi32(rest(a), 16), rest(b));
}

inline __m256i load_bits(const void* p) {
  return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
}

// float32 of 16 bit patterns of T (float16 or bfloat16).
template <typename T>
inline __m512 widen(__m256i bits) {
  if constexpr (std::is_same_v<T, mx::float16_t>) {
    return _mm512_cvtph_ps(bits);
  } else {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bits), 16));
  }
}

// Whether any of 16 bit patterns of T is inf or NaN: an all-ones exponent.
template <typename T>
inline bool any_non_finite(__m256i bits) {
  const short exponent = std::is_same_v<T, mx::float16_t> ? 0x7C00 : 0x7F80;
  const __m256i e = _mm256_set1_epi16(exponent);
  return _mm256_cmpeq_epi16_mask(_mm256_and_si256(bits, e), e) != 0;
}

// Per-thread buffers of one work item and block (bfloat16 as uint16_t), each
// starting on a cache line, as the rows of the tile loads then do.
struct Scratch {
  LineVector<uint16_t> q_hi, q_lo; // [groups, Dq / 32, 16 pairs, 16 rows, 2]
  LineVector<uint16_t> k_hi, k_lo; // [32 keys, Dq]
  LineVector<uint16_t> v_hi, v_lo; // [Dp / 16, 16 pairs, 16 d, 2]
  LineVector<uint16_t> p_hi, p_lo; // [16 rows, 32 keys]
  LineVector<float> s; // S^T, then P^T [32 keys, 16 rows]

  void reserve(int groups, int Dq, int Dp) {
    grow(q_hi, static_cast<size_t>(groups) * Dq * kRows);
    grow(q_lo, static_cast<size_t>(groups) * Dq * kRows);
    grow(k_hi, static_cast<size_t>(kKeys) * Dq);
    grow(k_lo, static_cast<size_t>(kKeys) * Dq);
    grow(v_hi, static_cast<size_t>(kKeys) * Dp);
    grow(v_lo, static_cast<size_t>(kKeys) * Dp);
    grow(p_hi, kRows * kKeys);
    grow(p_lo, kRows * kKeys);
    grow(s, kKeys * kRows);
  }

  template <typename E>
  static void grow(LineVector<E>& v, size_t n) {
    if (v.size() < n) {
      v.resize(n);
    }
  }
};

// Query rows [R, D] (unscaled, 16-bit, each with its own pointer, elements
// `stride` apart) as the right operand of the scores, per row group and chunk
// of 32 d: element (c, p, r, e) = q[row g*16 + r][c*32 + 2p + e], zero past D
// and past R. Returns false if a query is not finite.
template <typename T>
bool transpose_queries(const T* const* rows, int64_t stride, int R, int D, int Dq, Scratch& s) {
  const int groups = (R + kRows - 1) / kRows;
  const size_t size = static_cast<size_t>(groups) * Dq * kRows;
  std::memset(s.q_hi.data(), 0, size * sizeof(uint16_t));
  std::memset(s.q_lo.data(), 0, size * sizeof(uint16_t));
  // Dword e / 2 of a chunk goes to pair row e / 2, lane r: 16 dwords apart.
  const __m512i spread = _mm512_mullo_epi32(
      _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0), _mm512_set1_epi32(kRows));
  alignas(64) uint16_t x[32];
  for (int r = 0; r < R; ++r) {
    const int g = r / kRows, lane = r % kRows;
    for (int c = 0; c < Dq / 32; ++c) {
      __m512i bits;
      if (stride == 1) {
        // Contiguous rows: one masked load, which reads nothing past D.
        const int left = D - c * 32;
        const __mmask32 in = left >= 32 ? ~__mmask32{0} : left > 0 ? (__mmask32{1} << left) - 1 : 0;
        bits = _mm512_maskz_loadu_epi16(in, rows[r] + c * 32);
      } else {
        for (int e = 0; e < 32; ++e) {
          const int d = c * 32 + e;
          x[e] = d < D ? std::bit_cast<uint16_t>(rows[r][d * stride]) : 0;
        }
        bits = _mm512_load_si512(x);
      }
      const __m256i b0 = _mm512_castsi512_si256(bits), b1 = _mm512_extracti64x4_epi64(bits, 1);
      if (any_non_finite<T>(b0) || any_non_finite<T>(b1)) {
        return false;
      }
      __m512i h, l;
      split(widen<T>(b0), widen<T>(b1), top_halves(), h, l);
      const size_t at = (static_cast<size_t>(g) * (Dq / 32) + c) * kRows * kRows * 2 + lane * 2;
      _mm512_i32scatter_epi32(s.q_hi.data() + at, spread, h, 4);
      _mm512_i32scatter_epi32(s.q_lo.data() + at, spread, l, 4);
    }
  }
  return true;
}

// float16 keys t .. t+n-1 (rows[j], in place or gathered) as bfloat16 parts
// [32, Dq], zero past Dp and past n. Returns false on a non-finite key.
inline bool split_keys(const mx::float16_t* const* rows, int n, int Dp, int Dq, Scratch& s) {
  const __m512i order = top_halves();
  for (int j = 0; j < kKeys; ++j) {
    uint16_t* hi = s.k_hi.data() + static_cast<size_t>(j) * Dq;
    uint16_t* lo = s.k_lo.data() + static_cast<size_t>(j) * Dq;
    if (j >= n) {
      std::memset(hi, 0, Dq * sizeof(uint16_t));
      std::memset(lo, 0, Dq * sizeof(uint16_t));
      continue;
    }
    for (int d = 0; d < Dq; d += 32) {
      // Dp is a multiple of 16: a half chunk is all in the row or all past it.
      const __m512i bits = d + 16 < Dp ? _mm512_loadu_si512(rows[j] + d)
          : d < Dp                     ? _mm512_zextsi256_si512(load_bits(rows[j] + d))
                                       : _mm512_setzero_si512();
      const __m512i e = _mm512_set1_epi16(0x7C00);
      if (_mm512_cmpeq_epi16_mask(_mm512_and_si512(bits, e), e) != 0) {
        return false;
      }
      __m512i h, l;
      split(_mm512_cvtph_ps(_mm512_castsi512_si256(bits)), _mm512_cvtph_ps(_mm512_extracti64x4_epi64(bits, 1)),
            order, h, l);
      _mm512_storeu_si512(hi + d, h);
      _mm512_storeu_si512(lo + d, l);
    }
  }
  return true;
}

// bfloat16 keys, exact in one part, copied into k_hi [32, Dq] (zero past Dp
// and past n) when they cannot be read in place. They need no finiteness
// check: with no lo part each score is the same exact products as on the
// vector path.
inline void copy_keys(const mx::bfloat16_t* const* rows, int n, int Dp, int Dq, Scratch& s) {
  for (int j = 0; j < kKeys; ++j) {
    uint16_t* hi = s.k_hi.data() + static_cast<size_t>(j) * Dq;
    const int copied = j < n ? Dp : 0;
    if (j < n) {
      std::memcpy(hi, rows[j], Dp * sizeof(uint16_t));
    }
    std::memset(hi + copied, 0, (Dq - copied) * sizeof(uint16_t));
  }
}

// Values t .. t+n-1 in pairs of keys: element (c, p, d, e) = v[2p + e][c*16 + d],
// zero past n; float16 as bfloat16 parts hi and lo, bfloat16 in hi alone.
// Returns false on a non-finite value: a zero weight cannot cancel it in a
// tile product.
template <typename T>
bool pair_values(const T* const* rows, int n, int Dp, Scratch& s) {
  for (int p = 0; p < kKeys / 2; ++p) {
    for (int c = 0; c < Dp / 16; ++c) {
      const __m256i b0 = 2 * p < n ? load_bits(rows[2 * p] + c * 16) : _mm256_setzero_si256();
      const __m256i b1 = 2 * p + 1 < n ? load_bits(rows[2 * p + 1] + c * 16) : _mm256_setzero_si256();
      if (any_non_finite<T>(b0) || any_non_finite<T>(b1)) {
        return false;
      }
      const size_t at = (static_cast<size_t>(c) * (kKeys / 2) + p) * 32;
      if constexpr (std::is_same_v<T, mx::float16_t>) {
        __m512i h, l;
        split_pairs(_mm512_cvtph_ps(b0), _mm512_cvtph_ps(b1), h, l);
        _mm512_storeu_si512(s.v_hi.data() + at, h);
        _mm512_storeu_si512(s.v_lo.data() + at, l);
      } else {
        // bfloat16 bits interleaved word by word: b0's in the low words, b1's in the high ones.
        const __m512i x0 = _mm512_cvtepu16_epi32(b0), x1 = _mm512_slli_epi32(_mm512_cvtepu16_epi32(b1), 16);
        _mm512_storeu_si512(s.v_hi.data() + at, _mm512_or_si512(x0, x1));
      }
    }
  }
  return true;
}

// S^T [32 keys, 16 rows] of row group g: the sum of the products of the
// parts; float16 has three (hi.hi, hi.lo, lo.hi), bfloat16 one (its keys and
// queries have no lo part). keys: the hi part, with a row stride of k_stride elements (k_hi's
// Dq, or the cache's own rows read in place).
inline void scores(const Scratch& s, const uint16_t* keys, int64_t k_stride, int g, int Dq, bool split16, float* out) {
  _tile_zero(0);
  _tile_zero(1);
  const int stride = static_cast<int>(k_stride * sizeof(uint16_t));
  const int lo_stride = Dq * static_cast<int>(sizeof(uint16_t));
  for (int c = 0; c < Dq / 32; ++c) {
    const size_t q_at = (static_cast<size_t>(g) * (Dq / 32) + c) * kRows * kRows * 2;
    _tile_loadd(4, s.q_hi.data() + q_at, 64);
    _tile_loadd(2, keys + c * 32, stride);
    _tile_loadd(6, keys + 16 * k_stride + c * 32, stride);
    _tile_dpbf16ps(0, 2, 4);
    _tile_dpbf16ps(1, 6, 4);
    if (split16) {
      _tile_loadd(5, s.q_lo.data() + q_at, 64);
      _tile_loadd(3, s.k_lo.data() + c * 32, lo_stride);
      _tile_loadd(7, s.k_lo.data() + 16 * Dq + c * 32, lo_stride);
      _tile_dpbf16ps(0, 2, 5);
      _tile_dpbf16ps(1, 6, 5);
      _tile_dpbf16ps(0, 3, 4);
      _tile_dpbf16ps(1, 7, 4);
    }
  }
  _tile_stored(0, out, 64);
  _tile_stored(1, out + 16 * kRows, 64);
}

// Online softmax of one block on the 16 rows of a group, lane r = row g*16 + r:
// scales S^T and caps it when cap > 0 (softcap16), in place, becoming P^T:
// weights exp(s - m_new), 0 outside each row's keys [lo, hi) and past n;
// updates the running max m and sum l and
// returns the factor alpha = exp(m_old - m_new) for the old accumulator (0
// when m_old is -inf). `whole`: every row attends all of [t, t + n). Requests
// the rows of `next`, a row of keys and one of values per key.
inline __m512 softmax(float* st, int t, int n, float scale, float cap, __m512i lo, __m512i hi, bool whole, __m512& m,
                      __m512& l, const NextBlock& next) {
  const __m512 neg_inf = _mm512_set1_ps(-__builtin_inff());
  const __m512 sc = _mm512_set1_ps(scale);
  __m512 m_new = m;
  for (int j = 0; j < n; ++j) {
    next.request(0, j);
    __m512 x = _mm512_mul_ps(_mm512_loadu_ps(st + j * kRows), sc);
    if (cap > 0.0f) {
      x = softcap16(x, cap);
    }
    if (!whole) {
      const __m512i key = _mm512_set1_epi32(t + j);
      const __mmask16 in = _mm512_cmple_epi32_mask(lo, key) & _mm512_cmplt_epi32_mask(key, hi);
      x = _mm512_mask_blend_ps(in, neg_inf, x);
    }
    _mm512_storeu_ps(st + j * kRows, x);
    // NaN scores do not become the max, like std::max(m, NaN) in the vector path.
    m_new = _mm512_mask_blend_ps(_mm512_cmp_ps_mask(m_new, x, _CMP_LT_OQ), m_new, x);
  }
  const __mmask16 empty = _mm512_cmp_ps_mask(m, neg_inf, _CMP_EQ_OQ);
  const __m512 alpha = _mm512_maskz_mov_ps(static_cast<__mmask16>(~empty), exp16(_mm512_sub_ps(m, m_new)));
  __m512 sum = _mm512_setzero_ps();
  for (int j = 0; j < n; ++j) {
    next.request(1, j);
    const __m512 x = _mm512_loadu_ps(st + j * kRows);
    // -inf (outside a range) gives weight 0, not exp(-inf - -inf) = NaN.
    const __mmask16 outside = _mm512_cmp_ps_mask(x, neg_inf, _CMP_EQ_OQ);
    const __m512 w = exp16(_mm512_mask_sub_ps(x, static_cast<__mmask16>(~outside), x, m_new));
    _mm512_storeu_ps(st + j * kRows, w);
    sum = _mm512_add_ps(sum, w);
  }
  for (int j = n; j < kKeys; ++j) {
    _mm512_storeu_ps(st + j * kRows, _mm512_setzero_ps());
    next.request(0, j);
    next.request(1, j);
  }
  l = _mm512_fmadd_ps(l, alpha, sum);
  m = m_new;
  return alpha;
}

// Transposes 16 x 16 dwords in registers: dword j of x[i] becomes dword i of x[j].
inline void transpose_dwords(__m512i x[16]) {
  __m512i t[16];
  for (int i = 0; i < 16; i += 2) {
    t[i] = _mm512_unpacklo_epi32(x[i], x[i + 1]);
    t[i + 1] = _mm512_unpackhi_epi32(x[i], x[i + 1]);
  }
  for (int i = 0; i < 16; i += 4) {
    x[i] = _mm512_unpacklo_epi64(t[i], t[i + 2]);
    x[i + 1] = _mm512_unpackhi_epi64(t[i], t[i + 2]);
    x[i + 2] = _mm512_unpacklo_epi64(t[i + 1], t[i + 3]);
    x[i + 3] = _mm512_unpackhi_epi64(t[i + 1], t[i + 3]);
  }
  for (int i = 0; i < 16; i += 8) {
    for (int j = 0; j < 4; ++j) {
      t[i + j] = _mm512_shuffle_i32x4(x[i + j], x[i + j + 4], 0x88);
      t[i + j + 4] = _mm512_shuffle_i32x4(x[i + j], x[i + j + 4], 0xDD);
    }
  }
  for (int j = 0; j < 8; ++j) {
    x[j] = _mm512_shuffle_i32x4(t[j], t[j + 8], 0x88);
    x[j + 8] = _mm512_shuffle_i32x4(t[j], t[j + 8], 0xDD);
  }
}

// One bfloat16 part (Low: lo, else hi) of P [16 rows, 32 keys] from P^T
// [32 keys, 16 rows] float32: keys 2p and 2p + 1 of all rows split into one
// vector whose dword r is row r's pair, then the 16 pairs' dwords transposed.
// One part at a time, so that its 16 vectors and the transpose's fit the 32
// registers.
template <bool Low>
inline void transpose_weight_part(const float* pt, uint16_t* out) {
  __m512i x[kKeys / 2];
  for (int p = 0; p < kKeys / 2; ++p) {
    __m512i h, l;
    split_pairs(_mm512_loadu_ps(pt + 2 * p * kRows), _mm512_loadu_ps(pt + (2 * p + 1) * kRows), h, l);
    x[p] = Low ? l : h;
  }
  transpose_dwords(x);
  for (int r = 0; r < kRows; ++r) {
    _mm512_storeu_si512(out + r * kKeys, x[r]);
  }
}

// P^T [32 keys, 16 rows] float32 -> P [16 rows, 32 keys] as bfloat16 parts.
inline void transpose_weights(const float* pt, Scratch& s) {
  transpose_weight_part<false>(pt, s.p_hi.data());
  transpose_weight_part<true>(pt, s.p_lo.data());
}

// acc[r] = alpha[r] * acc[r] + (P . V)[r] for the 16 rows of a group, acc
// [16, Dp] with row stride Dp (rows past the group's are scratch). The old
// accumulator is rescaled only where alpha is not 1 (once a row's max settles,
// rarely), then loaded into the tiles the products add to, two tiles of 16 d
// at a time so that their products are independent.
inline void accumulate(Scratch& s, int Dp, bool values_split, float* acc, __m512 alpha) {
  alignas(64) float a[kRows];
  _mm512_store_ps(a, alpha);
  const int stride = Dp * static_cast<int>(sizeof(float));
  for (int r = 0; r < kRows; ++r) {
    if (a[r] != 1.0f) {
      const __m512 f = _mm512_set1_ps(a[r]);
      float* row = acc + static_cast<size_t>(r) * Dp;
      for (int d = 0; d < Dp; d += 16) {
        _mm512_storeu_ps(row + d, _mm512_mul_ps(_mm512_loadu_ps(row + d), f));
      }
    }
  }
  _tile_loadd(2, s.p_hi.data(), 64);
  _tile_loadd(3, s.p_lo.data(), 64);
  const int chunks = Dp / 16;
  for (int c = 0; c < chunks; c += 2) {
    const bool pair = c + 1 < chunks;
    const size_t at = static_cast<size_t>(c) * (kKeys / 2) * 32;
    const size_t next = at + (kKeys / 2) * 32;
    _tile_loadd(0, acc + c * 16, stride);
    _tile_loadd(4, s.v_hi.data() + at, 64);
    _tile_dpbf16ps(0, 2, 4);
    _tile_dpbf16ps(0, 3, 4);
    if (pair) {
      _tile_loadd(1, acc + (c + 1) * 16, stride);
      _tile_loadd(6, s.v_hi.data() + next, 64);
      _tile_dpbf16ps(1, 2, 6);
      _tile_dpbf16ps(1, 3, 6);
    }
    if (values_split) {
      _tile_loadd(5, s.v_lo.data() + at, 64);
      _tile_dpbf16ps(0, 2, 5);
      if (pair) {
        _tile_loadd(7, s.v_lo.data() + next, 64);
        _tile_dpbf16ps(1, 2, 7);
      }
    }
    _tile_stored(0, acc + c * 16, stride);
    if (pair) {
      _tile_stored(1, acc + (c + 1) * 16, stride);
    }
  }
}

} // namespace mlx_batched_decode::cpu::MBD_CPU_ISA::amx

#endif
