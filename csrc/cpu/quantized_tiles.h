// The two inner loops of the kernel on quantized rows (mx.quantize's affine
// format: per group of g elements a scale s and a bias b, element = s * w + b
// for its unsigned integer w): scores against the integers directly and the
// weighted sum of value rows. The integers are widened to float32 in
// registers; no row is dequantized to memory (but for work items of many
// query rows: decode_kernel.cpp's dequantize_block).
//
// Generic vector code: with 8 lanes where AVX-512 is missing, else 16; and
// with AVX2, AVX512-VNNI or arm64's dot product (sdot), scores of 16-bit
// queries on int16 words (dot_rows_integer).
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

#if defined(__aarch64__) && defined(__ARM_FEATURE_DOTPROD)
#include <arm_neon.h>
#endif

#include "cpu/tiles.h"
#include "cpu/vector_math.h"

namespace mlx_batched_decode::cpu::MBD_CPU_ISA {

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

#if defined(__AVX512F__)
// The mask of lanes 0 .. k - 1 of 16 (none for k <= 0, all for k >= 16).
inline __mmask16 first_lanes(int k) {
  return static_cast<__mmask16>((1u << std::clamp(k, 0, 16)) - 1);
}
#endif

// Elements i .. i + W * kLanes - 1 (i a multiple of W * kLanes) of a row of
// Bits-wide integers as float32, v[W]. On AVX-512, 4-bit integers 32 at a
// time: their 16 bytes widened once, each nibble looked up in a table of 0
// .. 15 (vpermps reads an index's low 4 bits: the low nibbles need no mask),
// the low and high ones interleaved; 7 instructions where widen takes 12.
template <int Bits, int W>
inline void widen_slice(const uint32_t* row, int i, qvec (&v)[W]) {
#if defined(__AVX512F__)
  if constexpr (Bits == 4 && W % 2 == 0) {
    const __m512 table = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    const __m512i first = _mm512_setr_epi32(0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23);
    const __m512i second = _mm512_add_epi32(first, _mm512_set1_epi32(8));
    const uint8_t* bytes = reinterpret_cast<const uint8_t*>(row) + static_cast<unsigned>(i) / 2;
    for (int c = 0; c < W; c += 2) {
      const __m512i x = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(bytes + 8 * c)));
      const __m512 low = _mm512_permutexvar_ps(x, table);
      const __m512 high = _mm512_permutexvar_ps(_mm512_srli_epi32(x, 4), table);
      v[c] = (qvec)_mm512_permutex2var_ps(low, first, high);
      v[c + 1] = (qvec)_mm512_permutex2var_ps(low, second, high);
    }
    return;
  }
#endif
  for (int c = 0; c < W; ++c) {
    v[c] = widen<Bits>(row, i + kLanes * c);
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

#if (defined(__AVX512VNNI__) && defined(__AVX512BW__)) || defined(__AVX2__) || \
    (defined(__aarch64__) && defined(__ARM_FEATURE_DOTPROD))
// Scores of 16-bit queries on the keys' integers: each query group as int16
// words with a scale of its own (query_words), and the products summed
// exactly in int32 over the group: AVX512-VNNI's vpdpwssd on pairs of
// words of 16 keys side by side, AVX2's vpmaddwd and vpaddd on 16 words of a
// key (AVX-VNNI's vpdpwssd in one; the same integers), or on arm64 sdot on 16
// bytes of a key, twice: once with the words' high bytes, once with their low
// ones (sdot multiplies signed bytes, so 8-bit keys are centred, w - 128;
// integer_scores adds the 128 back).
// Exact enough: a query element is off by at most half its group's step,
// max |q_g| / (2 kWordPeak) (below float16's own rounding for elements above
// max |q_g| / 16), so |score error| <= sum_g max |q_g| / (2 kWordPeak) *
// |s_g| * sum_{e in g} |w_e|; a key element's own quantization step is
// max |k_g - b_g| / 255 (8-bit) or / 15. float32 queries keep the float32
// loops: that bound is above their rounding.
#define MBD_INTEGER_SCORES 1
inline constexpr bool kIntegerScores = true;

// The width's primitives of dot_rows_integer (keys along the lanes): wacc, the
// int32 sums of a tile's (query row, key) pairs; wquery, one chunk of a query
// row's words; wkey, one chunk of a key's integers. wzero; wload, a chunk of
// words pinned in a register for the tile's keys (see in_register); wdot, acc
// plus the chunk's products; wreduce, the sum of an accumulator; pack_words, a
// chunk of words stored as wload reads it (in place); widen_words, elements i
// .. i + kWordLanes - 1 (i a multiple of kWordLanes) of a row of Bits-wide
// integers in word_position order; reduce_8, out[i] = wreduce(v[i]) for i < 8,
// cheaper than 8 wreduce. kWordLanes: elements per chunk; every group size (32,
// 64, 128) is a multiple. kWordPeak: the largest word. kSignedKeys: whether
// widen_words gives signed bytes (8-bit keys centred).
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
typedef __m512i wvec;
using wacc = wvec;
using wquery = wvec;
using wkey = wvec;
inline constexpr int kWordLanes = 32;
inline constexpr float kWordPeak = 32767.0f;
inline constexpr bool kSignedKeys = false;

inline wvec wzero() {
  return _mm512_setzero_si512();
}

inline wvec wload(const int16_t* p) {
  wvec v = _mm512_loadu_si512(p);
  asm("" : "+v"(v));
  return v;
}

inline void pack_words(int16_t*) {}

inline wvec wdot(wvec acc, wvec k, wvec q) {
  return _mm512_dpwssd_epi32(acc, k, q);
}

inline int32_t wreduce(wvec v) {
  return _mm512_reduce_add_epi32(v);
}

template <int Bits>
inline wvec widen_words(const uint32_t* row, int i) {
  const uint8_t* bytes = reinterpret_cast<const uint8_t*>(row) + static_cast<unsigned>(i) * Bits / 8;
  if constexpr (Bits == 8) {
    return _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(bytes)));
  } else {
    // The 16 bytes twice: low nibbles in the first 16 words, high ones in the last 16.
    const __m512i twice = _mm512_cvtepu8_epi16(
        _mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(bytes))));
    const __m512i shifts = _mm512_inserti64x4(_mm512_setzero_si512(), _mm256_set1_epi16(4), 1);
    return _mm512_and_si512(_mm512_srlv_epi16(twice, shifts), _mm512_set1_epi16(15));
  }
}

// 23 shuffles and adds, where 8 wreduce take 64.
inline void reduce_8(const __m512i (&v)[8], int32_t* out) {
  __m512i x[4];
  for (int i = 0; i < 4; ++i) {
    // 256-bit halves: v[2i] folded to 8 lanes, then v[2i + 1].
    x[i] = _mm512_add_epi32(_mm512_shuffle_i32x4(v[2 * i], v[2 * i + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                            _mm512_shuffle_i32x4(v[2 * i], v[2 * i + 1], _MM_SHUFFLE(3, 2, 3, 2)));
  }
  __m512i y[2];
  for (int i = 0; i < 2; ++i) {
    // 128-bit lanes: v[4i] .. v[4i + 3] folded to 4 lanes each.
    y[i] = _mm512_add_epi32(_mm512_shuffle_i32x4(x[2 * i], x[2 * i + 1], _MM_SHUFFLE(2, 0, 2, 0)),
                            _mm512_shuffle_i32x4(x[2 * i], x[2 * i + 1], _MM_SHUFFLE(3, 1, 3, 1)));
  }
  // Lane k of y[0] holds v[k] (a0..a3), of y[1] v[4 + k] (b0..b3): fold to
  // [a0 + a2, b0 + b2, a1 + a3, b1 + b3], then to the two sums.
  const __m512i z = _mm512_add_epi32(_mm512_unpacklo_epi32(y[0], y[1]), _mm512_unpackhi_epi32(y[0], y[1]));
  alignas(64) int32_t sums[16];
  _mm512_store_si512(sums, _mm512_add_epi32(z, _mm512_shuffle_epi32(z, _MM_PERM_BADC)));
  for (int k = 0; k < 4; ++k) {
    out[k] = sums[4 * k];
    out[4 + k] = sums[4 * k + 1];
  }
}
#elif defined(__AVX2__)
typedef __m256i wvec;
using wacc = wvec;
using wquery = wvec;
using wkey = wvec;
inline constexpr int kWordLanes = 16;
inline constexpr float kWordPeak = 32767.0f;
inline constexpr bool kSignedKeys = false;

inline wvec wzero() {
  return _mm256_setzero_si256();
}

inline wvec wload(const int16_t* p) {
  wvec v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  asm("" : "+x"(v));
  return v;
}

inline void pack_words(int16_t*) {}

inline wvec wdot(wvec acc, wvec k, wvec q) {
#if defined(__AVXVNNI__)
  return _mm256_dpwssd_avx_epi32(acc, k, q);
#else
  return _mm256_add_epi32(acc, _mm256_madd_epi16(k, q));
#endif
}

inline int32_t wreduce(wvec v) {
  const __m128i x = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  const __m128i y = _mm_add_epi32(x, _mm_shuffle_epi32(x, _MM_SHUFFLE(1, 0, 3, 2)));
  return _mm_cvtsi128_si32(_mm_add_epi32(y, _mm_shuffle_epi32(y, _MM_SHUFFLE(2, 3, 0, 1))));
}

template <int Bits>
inline wvec widen_words(const uint32_t* row, int i) {
  const uint8_t* bytes = reinterpret_cast<const uint8_t*>(row) + static_cast<unsigned>(i) * Bits / 8;
  if constexpr (Bits == 8) {
    return _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(bytes)));
  } else {
    // The 8 bytes' low nibbles, then their high ones (AVX2 has no 16-bit variable shift).
    const __m128i x = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(bytes));
    const __m128i low = _mm_and_si128(x, _mm_set1_epi8(15));
    const __m128i high = _mm_and_si128(_mm_srli_epi16(x, 4), _mm_set1_epi8(15));
    return _mm256_cvtepu8_epi16(_mm_unpacklo_epi64(low, high));
  }
}

// 9 shuffles and adds, where 8 wreduce take 56.
inline void reduce_8(const __m256i (&v)[8], int32_t* out) {
  // Within each 128-bit lane: pairs, then quads; u0 holds v[0..3]'s halves, u1 v[4..7]'s.
  const __m256i u0 = _mm256_hadd_epi32(_mm256_hadd_epi32(v[0], v[1]), _mm256_hadd_epi32(v[2], v[3]));
  const __m256i u1 = _mm256_hadd_epi32(_mm256_hadd_epi32(v[4], v[5]), _mm256_hadd_epi32(v[6], v[7]));
  const __m256i sums =
      _mm256_add_epi32(_mm256_permute2x128_si256(u0, u1, 0x20), _mm256_permute2x128_si256(u0, u1, 0x31));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(out), sums);
}
#else
// A query word x is 256 * hi + lo, hi = (x + 128) >> 8 and lo its low byte,
// both signed bytes when |x| <= 32639; a chunk of 16 words is stored as their
// 16 high bytes, then their 16 low ones (pack_words).
struct wacc {
  int32x4_t hi, lo;
};
struct wquery {
  int8x16_t hi, lo;
};
using wkey = int8x16_t;
inline constexpr int kWordLanes = 16;
inline constexpr float kWordPeak = 32639.0f;
inline constexpr bool kSignedKeys = true;

inline wacc wzero() {
  return {vdupq_n_s32(0), vdupq_n_s32(0)};
}

inline wquery wload(const int16_t* p) {
  const int8_t* bytes = reinterpret_cast<const int8_t*>(p);
  return {vld1q_s8(bytes), vld1q_s8(bytes + kWordLanes)};
}

inline void pack_words(int16_t* chunk) {
  int8_t bytes[2 * kWordLanes];
  for (int e = 0; e < kWordLanes; ++e) {
    const int hi = (chunk[e] + 128) >> 8;
    bytes[e] = static_cast<int8_t>(hi);
    bytes[kWordLanes + e] = static_cast<int8_t>(chunk[e] - 256 * hi);
  }
  std::memcpy(chunk, bytes, sizeof(bytes));
}

inline wacc wdot(wacc acc, wkey k, wquery q) {
  return {vdotq_s32(acc.hi, k, q.hi), vdotq_s32(acc.lo, k, q.lo)};
}

// The four lanes of 256 * hi + lo; no lane passes 2^29 (see dot_rows_integer).
inline int32x4_t combine(wacc v) {
  return vaddq_s32(vshlq_n_s32(v.hi, 8), v.lo);
}

inline int32_t wreduce(wacc v) {
  return vaddvq_s32(combine(v));
}

template <int Bits>
inline wkey widen_words(const uint32_t* row, int i) {
  const uint8_t* bytes = reinterpret_cast<const uint8_t*>(row) + static_cast<unsigned>(i) * Bits / 8;
  if constexpr (Bits == 8) {
    return vreinterpretq_s8_u8(veorq_u8(vld1q_u8(bytes), vdupq_n_u8(0x80)));
  } else {
    // The 8 bytes' low nibbles, then their high ones.
    const uint8x8_t x = vld1_u8(bytes);
    return vreinterpretq_s8_u8(vcombine_u8(vand_u8(x, vdup_n_u8(15)), vshr_n_u8(x, 4)));
  }
}

// 6 pairwise adds and 8 combines, where 8 wreduce take 16.
inline void reduce_8(const wacc (&v)[8], int32_t* out) {
  int32x4_t c[8];
  for (int i = 0; i < 8; ++i) {
    c[i] = combine(v[i]);
  }
  vst1q_s32(out, vpaddq_s32(vpaddq_s32(c[0], c[1]), vpaddq_s32(c[2], c[3])));
  vst1q_s32(out + 4, vpaddq_s32(vpaddq_s32(c[4], c[5]), vpaddq_s32(c[6], c[7])));
}
#endif

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
// Work items of two query rows or more score 16 keys at a time with the keys
// across the lanes (dot_keys_across_lanes): no reduction per (row, key),
// where the tiles of keys along the lanes (dot_rows_integer) spent more
// shuffles on their sums' reductions than on widening the keys. A single
// row keeps the tiles: its reductions cost less than the transposes.
#define MBD_KEYS_ACROSS_LANES 1

inline bool keys_across_lanes(int rows) {
  return rows >= 2;
}

// The uint32 words of 16 key rows side by side: out[m] lane j = word m of
// rows[j] for m < words, out rounded up to 16 words (zeros past the row).
// A 16 x 16 transpose per 16 words: 64 shuffles, in four steps. Each row's
// 16 words are read with a request for the same words of its successor
// (ahead; rows relative to rows[0]), spread over the transposes.
inline void transpose_rows(const uint32_t* const* rows, int words, Lookahead ahead, __m512i* out) {
  for (int c = 0; c < words; c += 16) {
    const __mmask16 live = first_lanes(words - c);
    __m512i r[16];
    for (int i = 0; i < 16; ++i) {
      r[i] = _mm512_maskz_loadu_epi32(live, rows[i] + c);
      if (i < ahead.rows) {
        prefetch_l2(rows[i] + ahead.offset + c);
      }
    }
    // t[2k] 128-bit lane L: words 4L, 4L + 1 of rows 2k, 2k + 1 interleaved; t[2k + 1] words 4L + 2, 4L + 3.
    __m512i t[16];
    for (int i = 0; i < 16; i += 2) {
      t[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]);
      t[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]);
    }
    // u[4a + e] lane L: word 4L + e of rows 4a .. 4a + 3.
    __m512i u[16];
    for (int a = 0; a < 4; ++a) {
      const __m512i* p = t + 4 * a;
      u[4 * a] = _mm512_unpacklo_epi64(p[0], p[2]);
      u[4 * a + 1] = _mm512_unpackhi_epi64(p[0], p[2]);
      u[4 * a + 2] = _mm512_unpacklo_epi64(p[1], p[3]);
      u[4 * a + 3] = _mm512_unpackhi_epi64(p[1], p[3]);
    }
    // Word 4L + e of all 16 rows: lane L of u[e], u[4 + e], u[8 + e], u[12 + e].
    for (int e = 0; e < 4; ++e) {
      const __m512i lo01 = _mm512_shuffle_i32x4(u[e], u[4 + e], _MM_SHUFFLE(1, 0, 1, 0));
      const __m512i lo23 = _mm512_shuffle_i32x4(u[8 + e], u[12 + e], _MM_SHUFFLE(1, 0, 1, 0));
      const __m512i hi01 = _mm512_shuffle_i32x4(u[e], u[4 + e], _MM_SHUFFLE(3, 2, 3, 2));
      const __m512i hi23 = _mm512_shuffle_i32x4(u[8 + e], u[12 + e], _MM_SHUFFLE(3, 2, 3, 2));
      _mm512_store_si512(out + c + e, _mm512_shuffle_i32x4(lo01, lo23, _MM_SHUFFLE(2, 0, 2, 0)));
      _mm512_store_si512(out + c + 4 + e, _mm512_shuffle_i32x4(lo01, lo23, _MM_SHUFFLE(3, 1, 3, 1)));
      _mm512_store_si512(out + c + 8 + e, _mm512_shuffle_i32x4(hi01, hi23, _MM_SHUFFLE(2, 0, 2, 0)));
      _mm512_store_si512(out + c + 12 + e, _mm512_shuffle_i32x4(hi01, hi23, _MM_SHUFFLE(3, 1, 3, 1)));
    }
  }
}

// The integer dot products of H query rows, as int16 words qw [H, Dn]
// (query_words in across_lanes_position order), with 16 keys transposed by
// transpose_rows (kt), per group: sums[(h * groups + g) * sums_stride + j] =
// dot(qw_hg, w_jg) for j < 16, exact. Per key word and query row, E / 2
// vpdpwssd on a broadcast pair of query words; each part of a key word is one
// shift and one mask.
template <int Bits, int H>
inline void dot_keys_across_lanes(const int16_t* qw, int Dn, const __m512i* kt, int groups, int group_size,
                                  int32_t* sums, int sums_stride) {
  constexpr int E = 32 / Bits, P = E / 2;
  const __m512i mask = _mm512_set1_epi16((1 << Bits) - 1);
  for (int g = 0; g < groups; ++g) {
    // Two sums per row, even and odd parts: a row's vpdpwssd form two
    // dependency chains, not one.
    __m512i acc[H][2];
    for (int h = 0; h < H; ++h) {
      acc[h][0] = acc[h][1] = _mm512_setzero_si512();
    }
    // No int32 overflow: a whole group's sum is at most 128 * 255 * 32767 < 2^30.
    for (int m = g * group_size / E; m < (g + 1) * group_size / E; ++m) {
      const __m512i x = _mm512_load_si512(kt + m);
      // Unrolled, so that the sums stay in registers.
#pragma GCC unroll 4
      for (int p = 0; p < P; ++p) {
        const __m512i shifted = _mm512_srli_epi16(x, Bits * p);
        const __m512i k = p == P - 1 ? shifted : _mm512_and_si512(shifted, mask);
#pragma GCC unroll 8
        for (int h = 0; h < H; ++h) {
          // The pair of query words broadcast from memory within the
          // instruction; GCC's intrinsic copied each sum to another register
          // around every vpdpwssd (two moves per product in the loop).
          const int16_t* pair = qw + h * Dn + E * m + 2 * p;
          __m512i sum = acc[h][p % 2];
          asm("vpdpwssd %2%{1to16%}, %1, %0" : "+v"(sum) : "v"(k), "m"(*reinterpret_cast<const int32_t*>(pair)));
          acc[h][p % 2] = sum;
        }
      }
    }
    for (int h = 0; h < H; ++h) {
      _mm512_storeu_si512(sums + (h * groups + g) * sums_stride, _mm512_add_epi32(acc[h][0], acc[h][1]));
    }
  }
}
#endif

// What widen_words takes off each 8-bit integer: 128 where the keys are read
// as signed bytes (kSignedKeys: sdot), else 0.
template <int Bits>
inline constexpr int kKeyCentre = Bits == 8 && kSignedKeys ? 128 : 0;

// Where element e of a row sits among the int16 words of its kWordLanes-element
// chunk: in order for 8-bit keys; for 4-bit keys, the low nibbles of the
// chunk's bytes, then the high ones (the order widen_words gives).
template <int Bits>
constexpr int word_position(int e) {
  const int i = e % kWordLanes;
  return e - i + (Bits == 8 ? i : i / 2 + (i % 2) * (kWordLanes / 2));
}

// Where element e of a row sits among the int16 words with keys across the
// lanes (dot_keys_across_lanes): a key's uint32 word of E = 32 / Bits
// integers is read as the int16 lanes of its two 16-bit halves, part p (p <
// E / 2) holding elements p and p + E / 2 of the word (integer p of each
// half); their query words lie side by side, a pair for one vpdpwssd lane.
template <int Bits>
constexpr int across_lanes_position(int e) {
  constexpr int E = 32 / Bits, P = E / 2;
  const int i = e % E;
  return e - i + 2 * (i % P) + i / P;
}

// One group of a scaled float32 query row, q [group_size], as int16 words in
// word_position order, each chunk packed (pack_words), or in
// across_lanes_position order; returns the group's scale (q ~ scale *
// words). A group of zeros has scale 0; a non-finite element gives a NaN
// scale, so that the scores are NaN as the float32 loops' would be.
template <int Bits>
inline float query_words(const float* q, int group_size, bool across_lanes, int16_t* words) {
  float peak = 0.0f;
#pragma omp simd reduction(max : peak)
  for (int e = 0; e < group_size; ++e) {
    peak = std::max(peak, std::fabs(q[e]));
  }
  if (!std::isfinite(peak)) {
    std::fill(words, words + group_size, int16_t{0});
    return NAN;
  }
  const float to_words = peak > 0.0f ? kWordPeak / peak : 0.0f;
  for (int e = 0; e < group_size; ++e) {
    // |q[e] * to_words| <= kWordPeak up to rounding: the clamp keeps it there.
    const float word = std::clamp(std::nearbyint(q[e] * to_words), -kWordPeak, kWordPeak);
    words[across_lanes ? across_lanes_position<Bits>(e) : word_position<Bits>(e)] = static_cast<int16_t>(word);
  }
  for (int c = 0; c < group_size && !across_lanes; c += kWordLanes) {
    pack_words(words + c);
  }
  return peak / kWordPeak;
}

// The integer dot products of a tile of H query rows, as int16 words qw
// [H, Dn] (query_words), with C key rows per group: sums[(h * groups + g) *
// sums_stride + c] = dot(qw_hg, w_cg - kKeyCentre), exact. The caller
// applies the scales once per block, 16 keys at a time (integer_scores).
template <int Bits, int D, int H, int C>
inline void dot_rows_integer(
    const int16_t* qw,
    const uint32_t* const* rows,
    int32_t* sums,
    int sums_stride,
    int dim,
    int group_size) {
  const int Dn = D ? D : dim;
  const int groups = Dn / group_size;
  for (int g = 0; g < groups; ++g) {
    wacc s[H][C];
    for (int h = 0; h < H; ++h) {
      for (int c = 0; c < C; ++c) {
        s[h][c] = wzero();
      }
    }
    // No int32 overflow: a whole group's sum is at most 128 * 255 * 32767 < 2^30.
    for (int i = g * group_size; i < (g + 1) * group_size; i += kWordLanes) {
      wkey k[C];
      for (int c = 0; c < C; ++c) {
        k[c] = widen_words<Bits>(rows[c], i);
      }
      for (int h = 0; h < H; ++h) {
        const wquery qh = wload(qw + h * Dn + i);
        for (int c = 0; c < C; ++c) {
          s[h][c] = wdot(s[h][c], k[c], qh);
        }
      }
    }
    int32_t out[H][C];
    if constexpr (H * C == 8) {
      reduce_8(reinterpret_cast<const wacc(&)[8]>(s), &out[0][0]);
    } else {
      for (int h = 0; h < H; ++h) {
        for (int c = 0; c < C; ++c) {
          out[h][c] = wreduce(s[h][c]);
        }
      }
    }
    for (int h = 0; h < H; ++h) {
      for (int c = 0; c < C; ++c) {
        sums[(h * groups + g) * sums_stride + c] = out[h][c];
      }
    }
  }
}

// Scores of R query rows from their integer dot products sums [R, groups,
// block] (dot_rows_integer) for keys j < n: scores[r * block + j] = sum over
// groups g of scales[g][j] * qscale[r][g] * sums[r][g][j] + (biases[g][j] +
// kKeyCentre * scales[g][j]) * qsum[r][g], scales and biases [groups, block].
template <int Bits>
inline void integer_scores(const int32_t* sums, const float* qscale, const float* qsum, const float* scales,
                           const float* biases, int R, int groups, int block, int n, float* scores) {
  for (int r = 0; r < R; ++r) {
    float* out = scores + r * block;
#pragma omp simd
    for (int j = 0; j < n; ++j) {
      out[j] = 0.0f;
    }
    for (int g = 0; g < groups; ++g) {
      const int32_t* sg = sums + (r * groups + g) * block;
      const float qs = qscale[r * groups + g], qb = qsum[r * groups + g];
      const float* kg = scales + g * block;
      const float* bg = biases + g * block;
#pragma omp simd
      for (int j = 0; j < n; ++j) {
        float bias = bg[j];
        if constexpr (kKeyCentre<Bits> != 0) {
          // A centred key element is s * (w - 128) + (b + 128 s).
          bias += kKeyCentre<Bits> * kg[j];
        }
        out[j] += static_cast<float>(sg[j]) * (kg[j] * qs) + bias * qb;
      }
    }
  }
}

#else
inline constexpr bool kIntegerScores = false;
#endif

#if !defined(MBD_KEYS_ACROSS_LANES)
inline bool keys_across_lanes(int) {
  return false;
}
#endif

// The weights of a value block for one query row and group: ws[j] = w[j] *
// s[j], and the returned sum_j w[j] * b[j], over keys j < n whose bit in `in`
// is set (the others weigh 0 in both); s and b the group's scales and
// biases. On vector lanes, not one chain of dependent adds (as such this took
// 16% of the value loop's time, 4-bit, K/V in cache); on AVX-512 the lanes'
// sum is a tree, where GCC ended its simd reduction with a chain of 16 adds.
inline float weigh_values(const float* w, const float* s, const float* b, int n, uint32_t in, float* ws) {
#if defined(__AVX512F__)
  __m512 sum = _mm512_setzero_ps();
  for (int j = 0; j < n; j += 16) {
    const __mmask16 live = first_lanes(n - j), use = live & static_cast<__mmask16>(in >> j);
    const __m512 wj = _mm512_maskz_loadu_ps(use, w + j);
    _mm512_mask_storeu_ps(ws + j, live, _mm512_mul_ps(wj, _mm512_maskz_loadu_ps(use, s + j)));
    sum = _mm512_fmadd_ps(wj, _mm512_maskz_loadu_ps(use, b + j), sum);
  }
  return _mm512_reduce_add_ps(sum);
#else
  float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
  for (int j = 0; j < n; ++j) {
    const bool use = in >> j & 1u;
    ws[j] = use ? w[j] * s[j] : 0.0f;
    sum += use ? w[j] * b[j] : 0.0f;
  }
  return sum;
#endif
}

// Weighted value rows of integers into the rescaled accumulators of a tile of
// H query rows: acc[h] = alpha[h] * acc[h] + bias_sum[h * groups + g] +
// sum_j ws[(h * groups + g) * ws_stride + j] * w_j, element by element, g the
// group of the element, j < n, where ws holds each row's softmax weight times
// the row's scale of the group and bias_sum the weighted biases of the group.
// As accumulate_rows, a slice of acc stays in registers over all n rows;
// slices are at most 32 elements, so that each lies in one group, or 64 on
// 16 lanes when Wide (groups and the row of multiples of 64): each weight is
// then broadcast once per 64 elements. The first slice requests the lines of
// each row's successor (words per row), see Lookahead.
template <int Bits, int D, int H, bool Wide = false>
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
    int words,
    Lookahead ahead) {
  // Vectors per slice: at most 32 elements (64 when Wide), and dividing the row.
  constexpr int W = kLanes == 16 ? (Wide ? 4 : 2) : (slice_vectors<8>(D, H) < 4 ? slice_vectors<8>(D, H) : 4);
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
          prefetch_l2(reinterpret_cast<const char*>(rows[j] + ahead.offset) + byte);
        }
      }
      qvec v[W];
      widen_slice<Bits>(rows[j], i, v);
      for (int h = 0; h < H; ++h) {
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

} // namespace mlx_batched_decode::cpu::MBD_CPU_ISA
