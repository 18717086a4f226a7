// The CPU decode attention kernel. This file is compiled once per instruction
// set (see CMakeLists.txt); MBD_CPU_ISA names the namespace of each copy. The
// headers of its loops (vector_math.h, convert.h, lanes.h, tiles.h,
// quantized_tiles.h, amx_tiles.h, row_source.h) open that namespace too: their
// inline functions differ per build, and a copy the compiler leaves out of
// line must not serve another build (the linker keeps one per name).
#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdlib>
#include <iterator>
#include <limits>
#include <numeric>
#include <type_traits>
#include <utility>
#include <vector>

#include "cpu/amx_tiles.h"
#include "cpu/cache_lines.h"
#include "cpu/convert.h"
#include "cpu/decode_args.h"
#include "cpu/kernel_table.h"
#include "cpu/parallel_decode.h"
#include "cpu/quantized_tiles.h"
#include "cpu/row_source.h"
#include "cpu/tiles.h"
#include "cpu/vector_math.h"

namespace mlx_batched_decode::cpu::MBD_CPU_ISA {

namespace {

// Keys scored before the accumulator is rescaled: one rescale per block
// instead of one per key. A multiple of 16, the width of softmax_block.
constexpr int kBlock = 32;
static_assert(kBlock == 32, "a block's keys are the bits of one uint32_t mask");
constexpr float kNegInf = -std::numeric_limits<float>::infinity();

// Keys scored with the AVX512_BF16 dot product: bfloat16 rows in a variant
// compiled for it but not for AVX512-FP16 (VectorLanes). Their queries stay
// unscaled in bfloat16 (q_raw), exact, and the scale is applied to the scores.
#if defined(__AVX512BF16__) && defined(__AVX512VL__) && !defined(__AVX512FP16__)
template <typename T>
constexpr bool kBf16Dot = std::is_same_v<T, mx::bfloat16_t>;
#else
template <typename T>
constexpr bool kBf16Dot = false;
#endif

// Values weighted with the same dot product (accumulate_pairs, unmasked
// blocks): bfloat16 rows of a fast head dim that is a multiple of 32. Every
// block's weights, masked ones too, are rounded to bfloat16 (relative error <=
// 2^-9 each, as FlashAttention rounds P for P.V), and the softmax sums the
// rounded weights.
template <typename T, int D, int Bits>
constexpr bool kPairValues = kBf16Dot<T> && Bits == 0 && D != 0 && D % 32 == 0;

// The lanes of the vector loops (lanes.h): 16 in a variant compiled for
// AVX-512, for every dtype (the 8-lane loops are bound by their instructions
// at G = 4: on the AMD EPYC the 16-lane build takes 14-35% less CPU per key
// than the AVX2 one), else 8. Score tiles hold up to
// kScoreRows query rows: 4 on 16 lanes (4H accumulators, 4 keys and a query
// fit the 32 registers), 2 on 8.
#if defined(__AVX512F__)
using VectorLanes = Lanes16;
constexpr int kScoreRows = 4;
#else
using VectorLanes = Lanes8;
constexpr int kScoreRows = 2;
#endif

// A block whose keys reach at least kWideRows query rows (a prefill chunk's)
// runs, in the AVX2 variant, as two small GEMMs: the keys widened and
// transposed once (transpose_keys) and scored 6 rows x 16 keys at a time
// (dot_keys_major), the values weighted 6 rows at a time. Decode rows (G * L
// of a few) keep the tiles above, which read each key row in place. Not on
// SSE, whose 16 registers hold half the accumulators of a 6-row tile.
#if defined(__AVX2__) && !defined(__AVX512F__)
constexpr bool kKeysMajor = true;
#else
constexpr bool kKeysMajor = false;
#endif
constexpr int kWideRows = 48;

// Blocks of 16-bit keys and values run on AMX tiles in a build compiled for
// them (see amx_tiles.h), when the AMX variant is selected and a work item
// has enough query rows (DecodeArgs::tiles_for). float32 keeps the vector path.
#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__)
template <typename T>
constexpr bool kAmx = !std::is_same_v<T, float>;
#else
template <typename T>
constexpr bool kAmx = false;
#endif

// Per-thread scratch, one per row type, for the R = G * L query rows of a
// work item: scaled queries [R, Dp] (or unscaled ones in T, q_raw, for
// kBf16Dot), scores [R, kBlock], the softmax rescale factors of a block [R],
// the keys each row attends in a block (bit j: key t + j) [R], the key ranges
// of the L rows, the spans of rows a block's keys reach and a block of key or
// value rows [kBlock, Dp] gathered from a strided last axis or zero-padded to Dp.
template <typename T>
struct Scratch {
  LineVector<float> q;
  LineVector<T> q_raw;
  LineVector<float> scores;
  LineVector<float> alpha;
  LineVector<uint32_t> masks;
  LineVector<KeyRange> ranges;
  LineVector<KeyRange> spans;
  LineVector<T> block;
  LineVector<float> keys_t;

  void reserve(int R, int L, int Dp) {
    grow(q, static_cast<size_t>(R) * Dp);
    if constexpr (kBf16Dot<T>) {
      grow(q_raw, static_cast<size_t>(R) * Dp);
    }
    grow(scores, static_cast<size_t>(R) * kBlock);
    grow(alpha, static_cast<size_t>(R));
    grow(masks, static_cast<size_t>(R));
    grow(ranges, static_cast<size_t>(L));
    grow(spans, static_cast<size_t>(R) + 1);
    grow(block, static_cast<size_t>(kBlock) * Dp);
    if constexpr (kKeysMajor) {
      grow(keys_t, static_cast<size_t>(kBlock) * Dp);
    }
  }

  template <typename V>
  static void grow(LineVector<V>& v, size_t n) {
    if (v.size() < n) {
      v.resize(n);
    }
  }
};

template <typename T>
thread_local Scratch<T> tls_scratch;

// Whether rows of a head are copied into the scratch block rather than read
// in place: a strided last axis, or the generic kernel's zero padding.
template <int D>
bool gathered(const int64_t* stride) {
  return D == 0 || stride[3] != 1;
}

// Positions [t, t + n) of src: the rows a block requests from memory while it
// runs, when they have no fixed offset from its own rows (paged or gathered).
template <typename T>
struct Successors {
  RowSource<T> src;
  int t = 0, n = 0;
};

// The successors of block [t, t + n) of chunk c on side (0 keys, 1 values):
// the next block of c, else the first block of `following` (the chunk this
// thread runs next, at the head this pass reads), so that items do not each
// start cold; none past the last item, or into another request's buffer.
template <typename T>
Successors<T> block_successors(const DecodeArgs& a, const RowSource<T>& src, int side, const Chunk& c, int t, int n,
                               const Chunk* following) {
  if (t + n < c.t1) {
    return {src, t + n, std::min(kBlock, c.t1 - t - n)};
  }
  if (following == nullptr || following->t1 <= following->t0 || (a.requests != nullptr && following->b != c.b)) {
    return {src, 0, 0};
  }
  const RowSource<T> next = side ? row_source<T>(a, a.values, a.v_stride, following->b, following->h, following->shift)
                                 : row_source<T>(a, a.keys, a.k_stride, following->b, following->h, following->shift);
  return {next, following->t0, std::min(kBlock, following->t1 - following->t0)};
}

// load_block for a paged source whose rows are read in place: a position
// with no key points at zeros in block ([kBlock, Dp]). Given `next`, the
// first n rows of `after` become successor offsets in ahead [kBlock] for the
// vector loops to request; otherwise they are requested here, at once.
template <typename T>
uint32_t paged_block(const DecodeArgs& a, const RowSource<T>& src, int t, int n, const Successors<T>& after, T* block,
                     int Dp, const T** rows, Lookahead* next, int64_t* ahead) {
  const uint32_t all = n == kBlock ? ~0u : (1u << n) - 1;
  const uint32_t valid = src.paged_rows(t, n, rows);
  for (uint32_t empty = all & ~valid; empty != 0; empty &= empty - 1) {
    const int j = __builtin_ctz(empty);
    std::fill_n(block + j * Dp, Dp, T(0.0f));
    rows[j] = block + j * Dp;
  }
  for (int j = n; j % 4 != 0; ++j) {
    rows[j] = rows[n - 1];
  }
  if (next == nullptr) {
    after.src.prefetch(after.t, after.n, a.D);
    return valid;
  }
  const int m = std::min(n, after.n);
  const T* successors[kBlock];
  // Rows with no key, or no successor key, request their own row again: harmless.
  const uint32_t both = m > 0 ? after.src.paged_rows(after.t, m, successors) & valid : 0;
  for (int j = 0; j < m; ++j) {
    ahead[j] = both >> j & 1u ? successors[j] - rows[j] : 0;
  }
  *next = {0, m, ahead};
  return valid;
}

// Points rows[j] at position t + j of the source, for j < n, and returns the
// bits j of the positions that hold a key: all but those of a paged source
// whose table entry lies outside the pool, whose rows point at zeros in block
// instead. Rows are read in place when the last axis is contiguous, else
// gathered into block, the D elements of a row zero-padded to Dp. Gathered
// and paged rows have no fixed successor offset: given `next`, the first n
// rows of a paged source's `after` get one each (next->offsets, in ahead
// [kBlock]) for the vector loops to request (paged_block); otherwise they
// are requested here, at once. Rows n to the next multiple of 4 repeat row
// n - 1, so the scoring can run on whole groups of four; their scores are
// never read.
template <typename T, int D>
uint32_t load_block(const DecodeArgs& a, const RowSource<T>& src, int t, int n, const Successors<T>& after, T* block,
                    const T** rows, Lookahead* next = nullptr, int64_t* ahead = nullptr) {
  const int Dp = D ? D : a.Dp;
  const int64_t* stride = src.stride;
  if (!src.paged() && !gathered<D>(stride)) {
    // Dense rows read in place, one stride apart: no checks per row (the
    // general loop below reloads the strides for every row).
    const T* first = src.base + static_cast<int64_t>(t) * stride[2];
    const int64_t step = stride[2];
    for (int j = 0; j < n; ++j) {
      rows[j] = first + j * step;
    }
    for (int j = n; j % 4 != 0; ++j) {
      rows[j] = rows[n - 1];
    }
    return n == kBlock ? ~0u : (1u << n) - 1;
  }
  if (src.paged() && !gathered<D>(stride)) {
    return paged_block(a, src, t, n, after, block, Dp, rows, next, ahead);
  }
  // Gathered rows, dense or paged: copied into block.
  after.src.prefetch(after.t, after.n, a.D);
  uint32_t valid = 0;
  src.for_rows(t, n, [&](int j, const T* row) {
    T* copy = block + j * Dp;
    if (row == nullptr) {
      std::fill_n(copy, Dp, T(0.0f));
      rows[j] = copy;
      return;
    }
    valid |= 1u << j;
    if (stride[3] == 1) {
      std::copy_n(row, a.D, copy);
    } else {
      for (int i = 0; i < a.D; ++i) {
        copy[i] = row[i * stride[3]];
      }
    }
    std::fill(copy + a.D, copy + Dp, T(0.0f));
    rows[j] = copy;
  });
  for (int j = n; j % 4 != 0; ++j) {
    rows[j] = rows[n - 1];
  }
  return valid;
}

// Rows per page from which a paged item over several heads requests its
// successors whole, in memory order (whole_rows), instead of each head its own.
constexpr int kWholeRowPages = 16;

// The successors head pass `pass` of an item over `heads` heads requests, as
// a share of the next rows whole: first[j] + first_next.offsets[j] is the
// first head's successor of row j (load_block), and the other heads' parts
// of that row follow it head_stride apart. Pass i takes parts i * kBlock ..
// of all rows' parts in memory order (row-major, then head), one per row j <
// n of its own block, as offsets from rows[j] into ahead [kBlock]; so the
// passes of a whole block together request each successor row once, front
// to back.
template <typename T>
Lookahead whole_rows(const T* const* first, Lookahead first_next, const T* const* rows, int n, int pass, int heads,
                     int64_t head_stride, int64_t* ahead) {
  int count = 0;
  for (int j = 0; j < n && heads > 0; ++j, ++count) {
    const int part = pass * kBlock + j, row = part / heads, head = part % heads;
    if (row >= first_next.rows) {
      break;
    }
    // In elements, through addresses: rows of a position without a key point into the scratch block.
    const T* successor = first[row] + first_next.offsets[row] + head * head_stride;
    ahead[j] = (reinterpret_cast<intptr_t>(successor) - reinterpret_cast<intptr_t>(rows[j])) /
        static_cast<intptr_t>(sizeof(T));
  }
  return {0, count, ahead};
}

// Whether rows [0, n) lie one row stride apart, as one block of a dense head.
template <typename T>
bool contiguous_rows(const T* const* rows, int n, int64_t row_stride) {
  for (int j = 1; j < n; ++j) {
    if (rows[j] != rows[0] + j * row_stride) {
      return false;
    }
  }
  return true;
}

// Requests rows [0, n) of a [n, D] block with the given row stride into L2.
template <typename T, int D>
void prefetch_rows(const T* first, int64_t row_stride, int n) {
  for (int j = 0; j < n; ++j) {
    const char* row = reinterpret_cast<const char*>(first + j * row_stride);
    for (int byte = 0; byte < D * static_cast<int>(sizeof(T)); byte += 64) {
      prefetch_l2(row + byte);
    }
  }
}

// The rows to request while block [t, t + n) of chunk c runs: the next block
// of c, else the first block of the chunk this thread runs next, so that short
// chunks do not each start cold. Gathered and paged rows have no fixed
// successor offset and are requested by load_block instead.
template <int D>
Lookahead successor_rows(const DecodeArgs& a, const int64_t* stride, const Chunk& c, int t, int n, const Chunk* next) {
  if (gathered<D>(stride) || a.block_tables != nullptr) {
    return {};
  }
  if (t + n < c.t1) {
    return {kBlock * stride[2], std::min(kBlock, c.t1 - t - n)};
  }
  // A request of the ragged layout has its own buffer: no offset reaches the next one's.
  if (next == nullptr || next->t1 <= next->t0 || (a.requests != nullptr && next->b != c.b)) {
    return {};
  }
  const int64_t offset = int64_t{next->b - c.b} * stride[0] + int64_t{next->h - c.h} * stride[1] +
      int64_t{next->t0 + next->shift - t - c.shift} * stride[2];
  return {offset, std::min(kBlock, next->t1 - next->t0)};
}

// Covers query rows [r, R) with tiles of up to MaxH (6, 4 or 2) rows: calls
// tile.template operator()<H>(r) for as many tiles of MaxH as fit, then one
// of 4, one of 2 and one of 1 as the rest needs. Only the first tile of a
// block requests the next rows, since all tiles read the same rows.
template <int MaxH, typename Tile>
inline void for_row_tiles(int r, int R, Tile&& tile) {
  static_assert(MaxH == 2 || MaxH == 4 || MaxH == 6);
  for (; r + MaxH <= R; r += MaxH) {
    tile.template operator()<MaxH>(r);
  }
  if constexpr (MaxH == 6) {
    if (r + 4 <= R) {
      tile.template operator()<4>(r);
      r += 4;
    }
  }
  if constexpr (MaxH >= 4) {
    if (r + 2 <= R) {
      tile.template operator()<2>(r);
      r += 2;
    }
  }
  if (r < R) {
    tile.template operator()<1>(r);
  }
}

// Bits j < n of the keys t + j of a block that range r holds.
inline uint32_t block_mask(KeyRange r, int t, int n) {
  const int lo = std::max(r.lo - t, 0), hi = std::min(r.hi - t, n);
  if (hi <= lo) {
    return 0;
  }
  const uint32_t below_hi = hi == 32 ? ~0u : (1u << hi) - 1;
  return below_hi & ~((1u << lo) - 1);
}

// Query row r of work item c: request c.request(r / R), head g, row i.
template <typename T>
const T* query_row(const DecodeArgs& a, const Chunk& c, int r) {
  const int R = a.rows(), g = r % R / a.L, i = r % a.L;
  return static_cast<const T*>(a.queries) + c.request(r / R) * a.q_stride[0] +
      static_cast<int64_t>(c.h * a.G + g) * a.q_stride[1] + static_cast<int64_t>(a.first_row + i) * a.q_stride[2];
}

// Loads the query rows of work item c (one head) into q: scaled float32 rows
// [count * R, Dp] (unscaled T rows into q_raw for Raw, the kBf16Dot keys),
// zero-padded past D.
template <typename T, int D, bool Raw = kBf16Dot<T>>
void load_queries(const DecodeArgs& a, const Chunk& c, float* q, T* q_raw) {
  const int Dp = D ? D : a.Dp;
  for (int r = 0; r < c.count * a.rows(); ++r) {
    const T* qr = query_row<T>(a, c, r);
    if constexpr (Raw) {
      for (int e = 0; e < Dp; ++e) {
        q_raw[r * Dp + e] = e < a.D ? qr[e * a.q_stride[3]] : T(0.0f);
      }
    } else if (D != 0 && a.q_stride[3] == 1) {
      for (int e = 0; e < D; e += 8) {
        store8(q + r * D + e, load8(qr + e) * splat(a.scale));
      }
    } else {
      for (int e = 0; e < Dp; ++e) {
        q[r * Dp + e] = e < a.D ? static_cast<float>(qr[e * a.q_stride[3]]) * a.scale : 0.0f;
      }
    }
  }
}

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__)
// One work item's AMX state: the queries as tile operands and each row
// group's key ranges as lanes; block() runs one block of keys on the tiles.
// One per thread (tls_tiles), so that its buffers are reused by every item.
template <typename T>
struct AmxItem {
  int R = 0, groups = 0, Dp = 0, Dq = 0;
  bool usable = false;
  uint64_t blocks = 0; // computed on the tiles
  std::vector<const T*> q_rows; // [R]
  std::vector<KeyRange> group_keys; // [groups]: the keys every row of the group attends
  std::vector<KeyRange> group_reach; // [groups]: the keys some row of the group attends
  std::vector<int32_t> lo, hi; // [groups * 16]: row r's keys [lo, hi), 0 past R
  // A member, not a thread_local of its own: each block then needs no TLS lookup.
  amx::Scratch scratch;

  // Prepares item c for the tiles, or, when !wanted, leaves it to the vector
  // path. ranges: the key ranges of the L rows of each of c's requests.
  void begin(const DecodeArgs& a, const Chunk& c, int dp, const KeyRange* ranges, bool wanted) {
    usable = false;
    blocks = 0;
    if (!wanted) {
      return;
    }
    R = c.count * a.rows();
    groups = (R + amx::kRows - 1) / amx::kRows;
    Dp = dp;
    Dq = (dp + 31) / 32 * 32;
    scratch.reserve(groups, Dq, Dp);
    q_rows.resize(R);
    for (int r = 0; r < R; ++r) {
      q_rows[r] = query_row<T>(a, c, r);
    }
    // Queries that are not finite leave the item to the vector path.
    usable = amx::transpose_queries(q_rows.data(), a.q_stride[3], R, a.D, Dq, scratch);
    lo.assign(groups * amx::kRows, 0);
    hi.assign(groups * amx::kRows, 0);
    group_keys.assign(groups, {0, std::numeric_limits<int>::max()});
    group_reach.assign(groups, {std::numeric_limits<int>::max(), 0});
    for (int r = 0; r < R; ++r) {
      const KeyRange k = ranges[r / a.rows() * a.L + r % a.L];
      lo[r] = k.lo;
      hi[r] = k.hi;
      KeyRange& all = group_keys[r / amx::kRows];
      all = {std::max(all.lo, k.lo), std::min(all.hi, k.hi)};
      if (!k.empty()) {
        KeyRange& some = group_reach[r / amx::kRows];
        some = {std::min(some.lo, k.lo), std::max(some.hi, k.hi)};
      }
    }
    if (usable) {
      amx::configure();
    }
  }

  void end() {
    if (usable) {
      amx::release();
      count_tile_blocks(blocks);
    }
  }

  // Keys [t, t + n) of sources ks / vs into the state; false (nothing
  // changed) when a key or value of the block is not finite or a position
  // holds no key. load(side) points rows at the block's rows of the keys (0)
  // or values (1), as load_block does, and returns the bits of the positions
  // with a key.
  template <typename Load>
  bool block(const DecodeArgs& a, const RowSource<T>& ks, const RowSource<T>& vs, int t, int n, Lookahead k_next,
             Lookahead v_next, const T** rows, PartialState st, Load&& load) {
    if (!usable) {
      return false;
    }
    constexpr bool split16 = std::is_same_v<T, mx::float16_t>;
    amx::Scratch& s = scratch;
    const uint32_t all = n == 32 ? ~0u : (1u << n) - 1;
    if (load(0) != all) {
      return false;
    }
    // Whole blocks of bfloat16 keys in rows of whole 32-element chunks are
    // read by the tile loads in place, when their row stride fits the tile
    // loads' 32-bit byte stride.
    const uint16_t* keys = s.k_hi.data();
    int64_t k_stride = Dq;
    // The next block's rows are requested during the first row group's softmax.
    amx::NextBlock next;
    next.set(0, rows[0], a.k_stride[2], k_next.offset, k_next.rows, Dp);
    if constexpr (split16) {
      if (!amx::split_keys(rows, n, Dp, Dq, s)) {
        return false;
      }
    } else if (n == kBlock && Dp == Dq && contiguous_rows(rows, n, a.k_stride[2]) &&
               std::abs(a.k_stride[2]) < (int64_t{1} << 30)) {
      keys = reinterpret_cast<const uint16_t*>(rows[0]);
      k_stride = a.k_stride[2];
    } else {
      amx::copy_keys(rows, n, Dp, Dq, s);
    }
    load(1);
    next.set(1, rows[0], a.v_stride[2], v_next.offset, v_next.rows, Dp);
    if (!amx::pair_values(rows, n, Dp, s)) {
      return false;
    }
    bool requested = false; // the next block, by the first group computed
    for (int g = 0; g < groups; ++g) {
      const int first = g * amx::kRows;
      // A group none of whose rows attends the block (a chunk's early rows) keeps its state.
      if (group_reach[g].hi <= t || t + n <= group_reach[g].lo) {
        continue;
      }
      const bool whole = group_keys[g].lo <= t && t + n <= group_keys[g].hi;
      __m512 m = _mm512_loadu_ps(st.m + first), l = _mm512_loadu_ps(st.l + first);
      amx::scores(s, keys, k_stride, g, Dq, split16, s.s.data());
      const __m512 alpha = amx::softmax(s.s.data(), t, n, a.scale, a.softcap, _mm512_loadu_si512(lo.data() + first),
                                        _mm512_loadu_si512(hi.data() + first), whole, m, l,
                                        requested ? amx::NextBlock{} : next);
      requested = true;
      _mm512_storeu_ps(st.m + first, m);
      _mm512_storeu_ps(st.l + first, l);
      amx::transpose_weights(s.s.data(), s);
      amx::accumulate(s, Dp, split16, st.acc + static_cast<int64_t>(first) * Dp, alpha);
    }
    ++blocks;
    return true;
  }
};

template <typename T>
thread_local AmxItem<T> tls_tiles;
#endif

// Whether quantized keys are scored on their integers (dot_rows_integer):
// for 16-bit queries, where the int16 query words are exact enough.
template <typename T>
inline constexpr bool kScoresOnIntegers = kIntegerScores && !std::is_same_v<T, float>;

// The quantized row source's per-thread scratch: a block's packed rows
// gathered from a strided last axis, its rows dequantized [kBlock, Dp]
// (dequantize_block), the scales and biases of its
// keys and values as float32, group-major [4][groups, kBlock] (key scales, key
// biases, value scales, value biases; groups of the wider side, scratch_groups), the query rows' sums per group
// [R, groups], for integer scores their int16 words [R, Dp] and scales
// [R, groups] (query_words) and a block's integer dot products [R, groups,
// kBlock] (dot_rows_integer), 16 keys' words transposed where keys lie across
// the lanes (transpose_rows), and per block each row's weights times the value
// scales [R, groups, kBlock] and weighted value biases [R, groups].
struct QuantizedScratch {
  LineVector<uint32_t> words;
  LineVector<uint32_t> key_words;
  LineVector<float> rows;
  LineVector<float> sb;
  LineVector<float> qsum;
  LineVector<int16_t> qwords;
  LineVector<float> qscale;
  LineVector<int32_t> sums;
  LineVector<float> ws;
  LineVector<float> bias_sum;

  void reserve(int R, int words_per_row, int groups, int Dp) {
    Scratch<float>::grow(words, static_cast<size_t>(kBlock) * words_per_row);
    Scratch<float>::grow(key_words, static_cast<size_t>(16) * ((words_per_row + 15) / 16 * 16));
    Scratch<float>::grow(rows, static_cast<size_t>(kBlock) * Dp);
    Scratch<float>::grow(sb, static_cast<size_t>(4) * groups * kBlock);
    Scratch<float>::grow(qsum, static_cast<size_t>(R) * groups);
    Scratch<float>::grow(qwords, static_cast<size_t>(R) * Dp);
    Scratch<float>::grow(qscale, static_cast<size_t>(R) * groups);
    Scratch<float>::grow(sums, static_cast<size_t>(R) * groups * kBlock);
    Scratch<float>::grow(ws, static_cast<size_t>(R) * groups * kBlock);
    Scratch<float>::grow(bias_sum, static_cast<size_t>(R) * groups);
  }
};

thread_local QuantizedScratch tls_quantized;

// Groups per row of the wider of keys and values: the stride of QuantizedScratch::sb.
inline int scratch_groups(const DecodeArgs& a) {
  return a.quant.groups(std::max(a.D, a.Dv));
}

// Elements first + j * step of a float16, bfloat16 or float32 array as float32, for j < n.
template <typename S>
void widen_strided(const void* base, int64_t first, int64_t step, int n, float* out) {
  const S* x = static_cast<const S*>(base) + first;
  for (int j = 0; j < n; ++j) {
    if constexpr (std::is_same_v<S, mx::float16_t>) {
#if defined(__F16C__)
      // One instruction, where the portable conversion takes a dozen (these
      // loops were a sixth of the quantized kernel's time).
      out[j] = _cvtsh_ss(std::bit_cast<uint16_t>(x[j * step]));
#else
      out[j] = half_bits_to_float(std::bit_cast<uint16_t>(x[j * step]));
#endif
    } else if constexpr (std::is_same_v<S, mx::bfloat16_t>) {
      out[j] = std::bit_cast<float>(static_cast<uint32_t>(std::bit_cast<uint16_t>(x[j * step])) << 16);
    } else {
      out[j] = x[j * step];
    }
  }
}

// The scales or biases of n keys from element `first` of base (strides st:
// key, group) as float32 out [groups, kBlock], 0 past n. Keys whose groups
// lie back to back (mx.quantize's layout) are widened 8 at a time (a
// conversion per element took 11% of the 8-bit kernel's samples, this 5%),
// then, for several groups, transposed: up to kMaxGroups groups, head dims
// to 512 at group size 32. On AVX-512, two groups (head dim 128 at group
// size 64) are split in registers: the transpose read back values just
// stored, and its loads waited on the stores (7-10% of the samples, K/V in
// cache, against 4% after).
inline constexpr int kMaxGroups = 16;

#if defined(__AVX512BW__) && defined(__AVX512VL__)
// Elements p[e] for e < 16 where bit e of live is set, else 0, as float32.
template <typename S>
inline __m512 widen_16(const S* p, __mmask16 live) {
  if constexpr (std::is_same_v<S, mx::float16_t>) {
    return _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(live, p));
  } else if constexpr (std::is_same_v<S, mx::bfloat16_t>) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(live, p)), 16));
  } else {
    return _mm512_maskz_loadu_ps(live, p);
  }
}
#endif

template <typename S>
void widen_groups(const void* base, int64_t first, const int64_t* st, int n, int groups, float* out) {
#if defined(__AVX512BW__) && defined(__AVX512VL__)
  if (groups == 2 && st[3] == 1 && st[2] == 2) {
    // The block's 64 values in four registers, split into even and odd elements.
    const S* x = static_cast<const S*>(base) + first;
    const __m512i even = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
    const __m512i odd = _mm512_add_epi32(even, _mm512_set1_epi32(1));
    for (int j = 0; j < kBlock; j += 16) {
      const int count = 2 * (n - j);
      const __m512 lo = widen_16(x + 2 * j, first_lanes(count));
      const __m512 hi = widen_16(x + 2 * j + 16, first_lanes(count - 16));
      _mm512_storeu_ps(out + j, _mm512_permutex2var_ps(lo, even, hi));
      _mm512_storeu_ps(out + kBlock + j, _mm512_permutex2var_ps(lo, odd, hi));
    }
    return;
  }
#endif
  if (st[3] == 1 && st[2] == groups && groups <= kMaxGroups) {
    const S* x = static_cast<const S*>(base) + first;
    const int count = n * groups;
    alignas(32) float wide[kBlock * kMaxGroups];
    float* to = groups == 1 ? out : wide;
    int e = 0;
    for (; e + 8 <= count; e += 8) {
      store8(to + e, load8(x + e));
    }
    widen_strided<S>(x, e, 1, count - e, to + e);
    for (int g = 0; g < groups && groups > 1; ++g) {
      for (int j = 0; j < n; ++j) {
        out[g * kBlock + j] = wide[j * groups + g];
      }
    }
  } else {
    for (int g = 0; g < groups; ++g) {
      widen_strided<S>(base, first + g * st[3], st[2], n, out + g * kBlock);
    }
  }
  for (int g = 0; g < groups; ++g) {
    std::fill(out + g * kBlock + n, out + (g + 1) * kBlock, 0.0f);
  }
}

// Points rows at the packed rows [t, t + n) of (b, h) of the keys (side 0)
// or values (side 1) and widens their scales and biases into s.sb; rows n to
// the next multiple of 16 repeat row n - 1 (load_block pads to 4), and their
// scales and biases are 0. Returns the rows one block on, for the loops to
// request from memory a row at a time (a burst of requests stalls on the
// core's miss buffers); none for gathered rows.
template <int Bits>
Lookahead load_quantized_block(const DecodeArgs& a, int side, int b, int h, int t, int n, int end,
                               QuantizedScratch& s, const uint32_t** rows) {
  const QuantizedRows& qr = a.quant;
  // Values may be narrower than keys (Dv < D).
  const int dim = side ? a.Dv : a.D;
  const int words = dim * Bits / 32, groups = qr.groups(dim);
  const int64_t* stride = side ? a.v_stride : a.k_stride;
  const uint32_t* head = static_cast<const uint32_t*>(side ? a.values : a.keys) + b * stride[0] + h * stride[1];
  for (int j = 0; j < n; ++j) {
    const uint32_t* row = head + (t + j) * stride[2];
    if (stride[3] == 1) {
      rows[j] = row;
      continue;
    }
    uint32_t* copy = s.words.data() + j * words;
    for (int w = 0; w < words; ++w) {
      copy[w] = row[w * stride[3]];
    }
    rows[j] = copy;
  }
  for (int j = n; j % 16 != 0; ++j) {
    rows[j] = rows[n - 1];
  }
  for (int kind = 0; kind < 2; ++kind) {
    const void* base = kind ? qr.biases[side] : qr.scales[side];
    const int64_t* st = kind ? qr.biases_stride[side] : qr.scales_stride[side];
    float* out = s.sb.data() + (2 * side + kind) * scratch_groups(a) * kBlock;
    const int64_t first = b * st[0] + h * st[1] + int64_t{t} * st[2];
    switch (qr.scales_dtype) {
      case Dtype::float16:
        widen_groups<mx::float16_t>(base, first, st, n, groups, out);
        break;
      case Dtype::bfloat16:
        widen_groups<mx::bfloat16_t>(base, first, st, n, groups, out);
        break;
      case Dtype::float32:
        widen_groups<float>(base, first, st, n, groups, out);
        break;
    }
  }
  if (stride[3] != 1) {
    return {};
  }
  return {kBlock * stride[2], std::clamp(end - t - kBlock, 0, kBlock)};
}

// Requests the lines of packed row `row + ahead.offset` when row j has a successor.
inline void prefetch_packed_row(const uint32_t* row, int j, int words, Lookahead ahead) {
  if (j < ahead.rows) {
    for (int byte = 0; byte < words * 4; byte += 64) {
      prefetch_l2(reinterpret_cast<const char*>(row + ahead.offset) + byte);
    }
  }
}

// Work items of at least kDequantizeRows query rows (GQA groups times L, or
// MLA's 128 heads on one KV head) read each block's rows dequantized once into
// float32 (dequantize_block) by the float kernels, the integers widened once
// per block rather than once per tile of query rows. Measured on AVX2 at head
// dims 128 and 512: faster from 16 rows at 8 bits, from 8 at 4 bits (whose
// widening costs more), slower below. With the keys scored across the lanes
// (AVX-512) the integers cost less: dequantized blocks were 9-14% slower at 16
// and 24 rows (8-bit) and 8-44% at 8-16 (4-bit), level at 32 and 24 (AMD EPYC
// Zen 4, head dim 128).
template <int Bits>
#if defined(MBD_KEYS_ACROSS_LANES)
inline constexpr int kDequantizeRows = Bits == 8 ? 32 : 24;
#else
inline constexpr int kDequantizeRows = Bits == 8 ? 16 : 8;
#endif

// The packed rows [t, t + n) of (b, h) of the keys (side 0) or values (side
// 1) dequantized into s.rows [kBlock, width] (width: the side's Dp or Dvp, a
// multiple of group_size), rows pointing at them; rows n to the next multiple
// of 8 repeat row n - 1, as load_block pads.
template <int Bits>
void dequantize_block(const DecodeArgs& a, int side, int b, int h, int t, int n, int end, QuantizedScratch& s,
                      int width, const float** rows) {
  const uint32_t* packed[kBlock];
  const Lookahead ahead = load_quantized_block<Bits>(a, side, b, h, t, n, end, s, packed);
  const int group_size = a.quant.group_size, stride = scratch_groups(a) * kBlock;
  const int words = (side ? a.Dv : a.D) * Bits / 32;
  const float* scales = s.sb.data() + 2 * side * stride;
  const float* biases = scales + stride;
  for (int j = 0; j < n; ++j) {
    prefetch_packed_row(packed[j], j, words, ahead);
    float* row = s.rows.data() + static_cast<int64_t>(j) * width;
    for (int g = 0; g < width / group_size; ++g) {
      const qvec scale = qsplat(scales[g * kBlock + j]), bias = qsplat(biases[g * kBlock + j]);
      for (int i = g * group_size; i < (g + 1) * group_size; i += kLanes) {
        qstore(row + i, widen<Bits>(packed[j], i) * scale + bias);
      }
    }
    rows[j] = row;
  }
  for (int j = n; j % 8 != 0; ++j) {
    rows[j] = rows[n - 1];
  }
}

// Scores of the R query rows (scaled float32 qs [R, Dp], group sums qsum;
// Integer: s.qwords and s.qscale) against the packed keys [t, t + n) of (b, h).
template <int Bits, int D, bool Integer>
void score_quantized_block(const DecodeArgs& a, const float* qs, int b, int h, int t, int n, int end, float* scores,
                           QuantizedScratch& s) {
  const int Dp = D ? D : a.Dp, groups = a.quant.groups(a.D);
  // Locals, not members of the thread_local scratch: GCC recomputes the
  // address of a thread_local (a call) in the loops that read it.
  const uint32_t* rows[kBlock];
  const Lookahead ahead = load_quantized_block<Bits>(a, 0, b, h, t, n, end, s, rows);
  const float* qsum = s.qsum.data();
  const int16_t* qwords = s.qwords.data();
  const float* qscale = s.qscale.data();
  int32_t* sums = s.sums.data();
  const float* scales = s.sb.data();
  const float* biases = scales + scratch_groups(a) * kBlock;
  const int words = a.D * Bits / 32, group_size = a.quant.group_size;
#if defined(MBD_KEYS_ACROSS_LANES)
  if (Integer && keys_across_lanes(a.rows())) {
    __m512i* kt = reinterpret_cast<__m512i*>(s.key_words.data());
    for (int j = 0; j < n; j += 16) {
      transpose_rows(rows + j, words, {ahead.offset, ahead.rows - j}, kt);
      for_row_tiles<6>(0, a.rows(), [&]<int H>(int r) {
        dot_keys_across_lanes<Bits, H>(qwords + r * Dp, Dp, kt, groups, group_size, sums + r * groups * kBlock + j,
                                       kBlock);
      });
    }
    integer_scores<Bits>(sums, qscale, qsum, scales, biases, a.rows(), groups, kBlock, n, scores);
    return;
  }
#endif
#if defined(MBD_INTEGER_SCORES)
  if constexpr (Integer) {
    // 8 (query row, key) sums per tile, for reduce_8: 4 rows x 2 keys, 2 x 4 or 1 x 8.
    for (int j = 0; j < n; j += 8) {
      for (int c = 0; c < 8; ++c) {
        prefetch_packed_row(rows[j + c], j + c, words, ahead);
      }
      for_row_tiles<4>(0, a.rows(), [&]<int H>(int r) {
        for (int c = j; c < j + 8; c += 8 / H) {
          dot_rows_integer<Bits, D, H, 8 / H>(qwords + r * Dp, rows + c, sums + r * groups * kBlock + c, kBlock, Dp,
                                              group_size);
        }
      });
    }
    integer_scores<Bits>(sums, qscale, qsum, scales, biases, a.rows(), groups, kBlock, n, scores);
    return;
  }
#endif
  for (int j = 0; j < n; j += kQuantKeys) {
    for (int c = 0; c < kQuantKeys; ++c) {
      prefetch_packed_row(rows[j + c], j + c, words, ahead);
    }
    for_row_tiles<4>(0, a.rows(), [&]<int H>(int r) {
      dot_rows_quantized<Bits, D, H, kQuantKeys>(qs + r * Dp, qsum + r * groups, rows + j, scales + j, biases + j,
                                                 kBlock, scores + r * kBlock + j, kBlock, Dp, group_size);
    });
  }
}

// The weights w [R, kBlock] of the packed values [t, t + n) of (b, h) into
// the accumulators, rescaled by alpha [R]; masks [R] as accumulate_rows.
template <int Bits, int D>
void accumulate_quantized_block(const DecodeArgs& a, int b, int h, int t, int n, int end, const float* w,
                                const float* alpha, const uint32_t* masks, bool masked, float* acc,
                                QuantizedScratch& s) {
  // The values' own width and groups (Dv may differ from D).
  const int Dvp = D ? D : a.Dvp, groups = a.quant.groups(a.Dv), R = a.rows();
  const uint32_t* rows[kBlock];
  const Lookahead ahead = load_quantized_block<Bits>(a, 1, b, h, t, n, end, s, rows);
  const float* scales = s.sb.data() + 2 * scratch_groups(a) * kBlock;
  const float* biases = scales + scratch_groups(a) * kBlock;
  for (int r = 0; r < R; ++r) {
    const float* wr = w + r * kBlock;
    // A key outside the row's range adds nothing, not 0 * NaN.
    const uint32_t in = masked ? masks[r] : ~0u;
    for (int g = 0; g < groups; ++g) {
      s.bias_sum[r * groups + g] = weigh_values(wr, scales + g * kBlock, biases + g * kBlock, n, in,
                                                s.ws.data() + (r * groups + g) * kBlock);
    }
  }
  // Locals, as rows: see score_quantized_block.
  const float* ws = s.ws.data();
  const float* bias_sum = s.bias_sum.data();
  const int words = a.Dv * Bits / 32, group_size = a.quant.group_size;
  // Masked keys weigh 0 in ws and bias_sum, and their integers are finite: no mask needed.
  auto tiles = [&]<bool Wide>() {
    for_row_tiles<4>(0, R, [&]<int H>(int r) {
      accumulate_rows_quantized<Bits, D, H, Wide>(acc + r * Dvp, alpha + r, ws + r * groups * kBlock, kBlock,
                                                  bias_sum + r * groups, rows, n, Dvp, group_size, words,
                                                  r == 0 ? ahead : Lookahead{});
    });
  };
  if (group_size % 64 == 0 && Dvp % 64 == 0) {
    tiles.template operator()<true>();
  } else {
    tiles.template operator()<false>();
  }
}

// score_quantized_block on the block's keys dequantized once (dequantize_block,
// kDequantizeRows): the float kernels' tiles, keys-major where wide (kt: the
// transposed keys' scratch [Dp, kBlock]).
template <int Bits, int D>
void score_dequantized_block(const DecodeArgs& a, const float* qs, int b, int h, int t, int n, int end, bool wide,
                             float* scores, float* kt, QuantizedScratch& s) {
  const int Dp = D ? D : a.Dp, R = a.rows();
  const float* rows[kBlock];
  dequantize_block<Bits>(a, 0, b, h, t, n, end, s, Dp, rows);
  if (kKeysMajor && wide) {
    transpose_keys<D, kBlock>(rows, n, Dp, kt, Lookahead{});
    for_row_tiles<6>(0, R, [&]<int H>(int r) {
      for (int j = 0; j < n; j += 16) {
        dot_keys_major<D, H>(qs + r * Dp, kt + j, kBlock, scores + r * kBlock + j, kBlock, Dp);
      }
    });
    return;
  }
  for (int j = 0; j < n; j += 4) {
    for_row_tiles<kScoreRows>(0, R, [&]<int H>(int r) {
      dot_4_rows<VectorLanes, D, H>(qs + r * Dp, rows + j, scores + r * kBlock + j, kBlock, Dp);
    });
  }
}

// accumulate_quantized_block on the block's values dequantized once, in the
// float kernels' tiles: of 6 rows on AVX2, as its wide dense blocks (a value
// row loaded once per 6 query rows), else of 4.
template <int Bits, int D>
void accumulate_dequantized_block(const DecodeArgs& a, int b, int h, int t, int n, int end, const float* w,
                                  const float* alpha, const uint32_t* masks, bool masked, float* acc,
                                  QuantizedScratch& s) {
  const int Dvp = D ? D : a.Dvp;
  const float* rows[kBlock];
  dequantize_block<Bits>(a, 1, b, h, t, n, end, s, Dvp, rows);
  auto tiles = [&]<bool Masked>() {
    for_row_tiles<kKeysMajor ? 6 : 4>(0, a.rows(), [&]<int H>(int r) {
      accumulate_rows<VectorLanes, D, H, Masked>(acc + r * Dvp, alpha + r, w + r * kBlock, kBlock, rows, n, Dvp,
                                                 masks + r);
    });
  };
  masked ? tiles.template operator()<true>() : tiles.template operator()<false>();
}

// One KV head of a work item: where its key and value rows live, its
// partial state and its query rows in the scratch (scaled float32 qs, or raw
// q_raw for kBf16Dot), loaded at the first block the vector path takes.
template <typename T>
struct HeadPass {
  Chunk c; // c.h: this head
  Chunk after; // the item this thread runs next, at this head (following)
  const Chunk* following = nullptr; // &after, or null: no next item, or it lacks this head
  RowSource<T> ks, vs;
  PartialState st;
  float* qs;
  T* q_raw;
  bool vector_queries = false;
};

// Attends the R query rows of one work item over its keys, 32 at a time:
// scores, the online softmax and the weighted values, with the rows read
// from a RowSource, dense strided views or pages of a pool (Bits == 0; T, the
// queries' dtype), or from the packed integers of a quantized cache (Bits 4
// or 8, see QuantizedRows; dense only). An item of c.heads > 1 KV heads (rows
// whose heads lie side by side, never quantized or on tiles) runs each block
// for every head in turn, so that whole rows stream in: states[i] is head
// c.h + i's.
template <typename T, int D, int Bits = 0>
void attend_chunk(const DecodeArgs& a, const Chunk& c, PartialState* states, const Chunk* next) {
  const int t0 = c.t0, t1 = c.t1;
  // Rows of all c.count requests; their L row ranges each are lines = count * L.
  const int R = c.count * a.rows(), L = a.L, lines = c.count * L;
  // Queries and keys are Dp wide, values and accumulators Dvp (the same for a fast head dim).
  const int Dp = D ? D : a.Dp, Dvp = D ? D : a.Dvp;
  const DecodeArgs av = a.value_rows();
  Scratch<T>& s = tls_scratch<T>;
  s.reserve(R * c.heads, lines, std::max(Dp, Dvp));
  float* scores = s.scores.data();
  float* alpha = s.alpha.data();
  uint32_t* masks = s.masks.data();

  for (int m = 0; m < c.count; ++m) {
    const int len = a.length(c.request(m)), start = a.start(c.request(m));
    for (int i = 0; i < L; ++i) {
      s.ranges[m * L + i] = a.row_range(len, start, i);
    }
  }
  // Whether AmxItem::begin may take this item (its condition there).
  bool tiles_may_run = false;
#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__)
  if constexpr (kAmx<T> && Bits == 0) {
    tiles_may_run = a.tiles_for(R) && c.heads == 1;
  }
#endif
  // At most kMaxItemHeads heads per item (parallel_decode.h).
  HeadPass<T> passes[kMaxItemHeads];
  for (int i = 0; i < c.heads; ++i) {
    HeadPass<T>& pass = passes[i];
    pass.c = c;
    pass.c.h = c.h + i;
    pass.c.heads = 1;
    // The members' tables hold the same pages over [t0, t1): the first one's is read.
    pass.ks = row_source<T>(a, a.keys, a.k_stride, c.b, pass.c.h, c.shift);
    pass.vs = row_source<T>(a, a.values, a.v_stride, c.b, pass.c.h, c.shift);
    if (next != nullptr && i < next->heads) {
      pass.after = *next;
      pass.after.h = next->h + i;
      pass.after.heads = 1;
      pass.following = &pass.after;
    }
    pass.st = states[i];
    pass.qs = s.q.data() + static_cast<int64_t>(i) * R * Dp;
    pass.q_raw = kBf16Dot<T> ? s.q_raw.data() + static_cast<int64_t>(i) * R * Dp : nullptr;
    // Rows past R too where the AMX path may run: it computes on whole groups of 16.
    for (int r = 0; r < (tiles_may_run ? PartialState::rows(R) : R); ++r) {
      pass.st.m[r] = kNegInf;
      pass.st.l[r] = 0.0f;
      std::fill_n(pass.st.acc + r * Dvp, Dvp, 0.0f);
    }
  }

  T* block = s.block.data();
  const T* rows[kBlock];
  int64_t k_ahead[kBlock], v_ahead[kBlock]; // a paged source's successor offsets (Lookahead)
  // Paged rows read in place: the first head walks a block's table entries
  // and the other heads' rows lie a head stride from its rows.
  const bool paged_heads = c.heads > 1 && passes[0].ks.paged() && !gathered<D>(a.k_stride) && !gathered<D>(a.v_stride);
  const T* first_rows[2][kBlock];
  Lookahead first_next[2];
  uint32_t first_valid = 0;
  // Pages of 16 rows or more are requested whole, in memory order (whole_rows):
  // measured 4-12% faster at block 16; at block 1 the heads' order of need
  // wins (13% slower whole).
  const bool by_rows = paged_heads && passes[0].ks.block_size >= kWholeRowPages;
  int64_t row_ahead[kBlock];
  // The successors head i's pass requests: whole rows, else its own head's.
  auto pass_next = [&](int side, int i, int t, int n) -> Lookahead {
    const int heads = t + n < t1 ? c.heads : next ? std::min(next->heads, c.heads) : 0;
    if (!by_rows) {
      return i < heads ? first_next[side] : Lookahead{};
    }
    const int64_t head_stride = side ? a.v_stride[1] : a.k_stride[1];
    return whole_rows(first_rows[side], first_next[side], rows, n, i, heads, head_stride, row_ahead);
  };
  // Rows of head i of side (0 keys, 1 values) into rows, from the first head's.
  auto shift_rows = [&](int side, int i, int n) {
    const int64_t step = i * (side ? a.v_stride[1] : a.k_stride[1]);
    for (int j = 0; j < n; ++j) {
      rows[j] = first_valid >> j & 1u ? first_rows[side][j] + step : first_rows[side][j];
    }
    for (int j = n; j % 4 != 0; ++j) {
      rows[j] = rows[n - 1];
    }
  };
#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__)
  AmxItem<T>& tiles = tls_tiles<T>;
  if constexpr (kAmx<T> && Bits == 0) {
    tiles.begin(a, c, Dp, s.ranges.data(), tiles_may_run);
  }
#endif
  QuantizedScratch& quantized = tls_quantized;
  if constexpr (Bits != 0) {
    const int groups = a.quant.groups(a.D);
    quantized.reserve(R, std::max(a.D, a.Dv) * Bits / 32, scratch_groups(a), std::max(Dp, Dvp));
    // Scaled float32 queries and their sums per group, the second term of q . k.
    load_queries<T, D, false>(a, c, passes[0].qs, nullptr);
    passes[0].vector_queries = true;
    for (int r = 0; r < R; ++r) {
      for (int g = 0; g < groups; ++g) {
        const float* q = passes[0].qs + r * Dp + g * a.quant.group_size;
        quantized.qsum[r * groups + g] = std::accumulate(q, q + a.quant.group_size, 0.0f);
        if constexpr (kScoresOnIntegers<T>) {
          quantized.qscale[r * groups + g] =
              query_words<Bits>(q, a.quant.group_size, keys_across_lanes(a.rows()),
                                quantized.qwords.data() + r * Dp + g * a.quant.group_size);
        }
      }
    }
  } else {
    for (int i = 0; i < c.heads; ++i) {
      const RowSource<T>& vs = passes[i].vs;
      if (vs.paged()) {
        // The first block's values are requested while its keys are scored, in
        // case no previous chunk requested them.
        vs.prefetch(t0, std::min(kBlock, t1 - t0), a.Dv);
      } else if (!gathered<D>(a.v_stride)) {
        prefetch_rows<T, D>(vs.base + t0 * a.v_stride[2], a.v_stride[2], std::min(kBlock, t1 - t0));
      }
    }
  }
  for (int t = t0; t < t1; t += kBlock) {
    const int n = std::min(kBlock, t1 - t);
    for (int i = 0; i < c.heads; ++i) {
      HeadPass<T>& pass = passes[i];
      const PartialState st = pass.st;
      const RowSource<T>& ks = pass.ks;
      const RowSource<T>& vs = pass.vs;
      float* qs = pass.qs;
      // The next rows are requested from memory while this block is computed:
      // hardware prefetchers stop at each 4 KiB page. Each head requests its
      // own rows of the next block; at the last block, the next item's.
      // Paged sources give their successors when their rows are loaded (load_block).
      Lookahead k_next = successor_rows<D>(a, a.k_stride, pass.c, t, n, pass.following);
      Lookahead v_next = successor_rows<D>(a, a.v_stride, pass.c, t, n, pass.following);
      const Successors<T> k_after = block_successors<T>(a, ks, 0, pass.c, t, n, pass.following);
      const Successors<T> v_after = block_successors<T>(a, vs, 1, pass.c, t, n, pass.following);

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__)
      if constexpr (kAmx<T> && Bits == 0) {
        if (tiles.block(a, ks, vs, t, n, k_next, v_next, rows, st, [&](int side) {
              return side ? load_block<T, D>(av, vs, t, n, v_after, block, rows)
                          : load_block<T, D>(a, ks, t, n, k_after, block, rows);
            })) {
          continue;
        }
      }
#endif
      // Loaded at the first block the vector path takes: with the tiles, maybe none.
      if (!pass.vector_queries) {
        load_queries<T, D>(a, pass.c, qs, pass.q_raw);
        pass.vector_queries = true;
      }
      uint32_t valid = n == 32 ? ~0u : (1u << n) - 1; // positions that hold a key
      if constexpr (Bits == 0) {
        if (paged_heads && i > 0) {
          shift_rows(0, i, n);
          valid = first_valid;
          k_next = pass_next(0, i, t, n);
        } else {
          valid = load_block<T, D>(a, ks, t, n, k_after, block, rows, &k_next, k_ahead);
          if (paged_heads) {
            std::copy_n(rows, kBlock, first_rows[0]);
            first_valid = valid;
            first_next[0] = k_next;
            k_next = pass_next(0, 0, t, n);
          }
        }
      }
      // Rows whose range cuts this block (L > 1: the rows' ends differ, and their
      // window starts; requests sharing pages have their own ranges) take no
      // score and no value from the keys outside it, nor from a position with no key.
      const uint32_t all = n == 32 ? ~0u : (1u << n) - 1;
      bool masked = false;
      int reached = 0; // lines some key of the block reaches
      for (int l = 0; l < lines; ++l) {
        masks[l] = block_mask(s.ranges[l], t, n) & valid;
        masked |= masks[l] != all;
        reached += masks[l] != 0;
      }
      // The rows the block's keys reach, as spans: all R rows, or (a prefill
      // chunk's early blocks, which its later rows alone attend) each head's
      // rows from its first reached line to its last, so that the causal
      // triangle costs half the square. The quantized loops take all rows.
      KeyRange* spans = s.spans.data();
      int n_spans = 0;
      int span_rows = 0;
      if (reached == lines || Bits != 0) {
        spans[n_spans++] = {0, R};
      } else {
        for (int m = 0; m < c.count; ++m) {
          int first = L, last = -1;
          for (int l = 0; l < L; ++l) {
            if (masks[m * L + l] != 0) {
              first = std::min(first, l);
              last = l;
            }
          }
          for (int g = 0; g < a.G && last >= 0; ++g) {
            const int lo = m * a.rows() + g * L + first, hi = m * a.rows() + g * L + last + 1;
            if (n_spans > 0 && spans[n_spans - 1].hi == lo) {
              spans[n_spans - 1].hi = hi;
            } else {
              spans[n_spans++] = {lo, hi};
            }
          }
        }
      }
      for (int sp = 0; sp < n_spans; ++sp) {
        span_rows += spans[sp].hi - spans[sp].lo;
      }
      const bool wide = span_rows >= kWideRows;
      // Each key row is read once and scored against the rows it reaches, two at
      // a time (four with the bfloat16 dot product), or keys-major (wide).
      if constexpr (Bits != 0) {
        if (R >= kDequantizeRows<Bits>) {
          score_dequantized_block<Bits, D>(a, qs, c.b, c.h, t, n, t1, wide, scores, s.keys_t.data(), quantized);
        } else {
          score_quantized_block<Bits, D, kScoresOnIntegers<T>>(a, qs, c.b, c.h, t, n, t1, scores, quantized);
        }
      } else {
        const int first_row = n_spans > 0 ? spans[0].lo : 0;
        if constexpr (kKeysMajor) {
          if (wide) {
            float* kt = s.keys_t.data();
            transpose_keys<D, kBlock>(rows, n, Dp, kt, k_next);
            for (int sp = 0; sp < n_spans; ++sp) {
              for_row_tiles<6>(spans[sp].lo, spans[sp].hi, [&]<int H>(int r) {
                for (int j = 0; j < n; j += 16) {
                  dot_keys_major<D, H>(qs + r * Dp, kt + j, kBlock, scores + r * kBlock + j, kBlock, Dp);
                }
              });
            }
          }
        }
        for (int j = 0; j < n && !(kKeysMajor && wide); j += 4) {
          const Lookahead ahead{k_next.offset, k_next.rows - j, k_next.offsets ? k_next.offsets + j : nullptr};
          for (int sp = 0; sp < n_spans; ++sp) {
#if defined(__AVX512BF16__) && defined(__AVX512VL__)
            if constexpr (kBf16Dot<T>) {
              for_row_tiles<4>(spans[sp].lo, spans[sp].hi, [&]<int H>(int r) {
                dot_4_rows<Bf16Pairs, D, H>(pass.q_raw + r * Dp, rows + j, scores + r * kBlock + j, kBlock, Dp,
                                            r == first_row ? ahead : Lookahead{}, a.scale);
              });
              continue;
            }
#endif
            for_row_tiles<kScoreRows>(spans[sp].lo, spans[sp].hi, [&]<int H>(int r) {
              dot_4_rows<VectorLanes, D, H>(qs + r * Dp, rows + j, scores + r * kBlock + j, kBlock, Dp,
                                            r == first_row ? ahead : Lookahead{});
            });
          }
        }
      }
      for (int sp = 0; sp < n_spans && a.softcap > 0.0f; ++sp) {
        for (int r = spans[sp].lo; r < spans[sp].hi; ++r) {
          softcap_scores(scores + r * kBlock, n, a.softcap);
        }
      }
      if (masked) {
        // Row r reads line r / (G * L) * L + r % L <= r: descending keeps the lines it needs.
        for (int sp = n_spans - 1; sp >= 0; --sp) {
          for (int r = spans[sp].hi - 1; r >= spans[sp].lo; --r) {
            masks[r] = masks[r / a.rows() * L + r % L];
            for (int j = 0; j < n; ++j) {
              if (!(masks[r] >> j & 1u)) {
                scores[r * kBlock + j] = kNegInf;
              }
            }
          }
        }
      }
      for (int sp = 0; sp < n_spans; ++sp) {
        for (int r = spans[sp].lo; r < spans[sp].hi; ++r) {
          alpha[r] = softmax_block<kPairValues<T, D, Bits>>(scores + r * kBlock, n, st.m[r], st.l[r]);
        }
      }

      if constexpr (Bits != 0) {
        if (R >= kDequantizeRows<Bits>) {
          accumulate_dequantized_block<Bits, D>(a, c.b, c.h, t, n, t1, scores, alpha, masks, masked, st.acc,
                                                quantized);
        } else {
          accumulate_quantized_block<Bits, D>(a, c.b, c.h, t, n, t1, scores, alpha, masks, masked, st.acc, quantized);
        }
        continue;
      }
      // Value rows in tiles of up to four query rows, each row chunk loaded once per tile.
      if (paged_heads && i > 0) {
        shift_rows(1, i, n);
        v_next = pass_next(1, i, t, n);
      } else {
        load_block<T, D>(av, vs, t, n, v_after, block, rows, &v_next, v_ahead);
        if (paged_heads) {
          std::copy_n(rows, kBlock, first_rows[1]);
          first_next[1] = v_next;
          v_next = pass_next(1, 0, t, n);
        }
      }
      // Tiles of 6 rows where the keys-major scores ran (wide), else of 4.
      auto value_tiles = [&](int lo, int hi, auto&& tile) {
        if constexpr (kKeysMajor) {
          if (wide) {
            for_row_tiles<6>(lo, hi, tile);
            return;
          }
        }
        for_row_tiles<4>(lo, hi, tile);
      };
      for (int sp = 0; sp < n_spans; ++sp) {
        if (masked) {
          value_tiles(spans[sp].lo, spans[sp].hi, [&]<int H>(int r) {
            accumulate_rows<VectorLanes, D, H, true>(st.acc + r * Dvp, alpha + r, scores + r * kBlock, kBlock, rows,
                                                     n, Dvp, masks + r);
          });
          continue;
        }
        value_tiles(spans[sp].lo, spans[sp].hi, [&]<int H>(int r) {
          const Lookahead ahead = r == spans[0].lo ? v_next : Lookahead{};
#if defined(__AVX512BF16__) && defined(__AVX512BW__)
          if constexpr (kPairValues<T, D, Bits>) {
            accumulate_pairs<D, H>(st.acc + r * Dvp, alpha + r, scores + r * kBlock, kBlock, rows, n, ahead);
            return;
          }
#endif
          accumulate_rows<VectorLanes, D, H, false>(st.acc + r * Dvp, alpha + r, scores + r * kBlock, kBlock, rows, n,
                                                    Dvp, nullptr, ahead);
        });
      }
    }
  }
#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__)
  if constexpr (kAmx<T> && Bits == 0) {
    tiles.end();
  }
#endif
}

template <typename T, int D>
void finalize(const DecodeArgs& a, int b, int h, float* parts, int n) {
  const int R = a.rows();
  const int Dvp = D ? D : a.Dvp;
  const int64_t part_size = PartialState::size(R, Dvp);
  T* out = static_cast<T*>(a.out) + b * a.out_stride[0] + static_cast<int64_t>(h) * a.G * a.out_stride[1] +
      static_cast<int64_t>(a.first_row) * a.out_stride[2];
  const int len = a.length(b), start = a.start(b);
  for (int r = 0; r < R; ++r) {
    T* o = out + r / a.L * a.out_stride[1] + r % a.L * a.out_stride[2];
    if (n == 0 || a.row_range(len, start, r % a.L).empty()) {
      std::fill_n(o, a.Dv, T(0.0f));
      continue;
    }
    float m = kNegInf;
    for (int c = 0; c < n; ++c) {
      m = std::max(m, PartialState::at(parts + c * part_size, R).m[r]);
    }
    // The sink joins the denominator only: one more logit, with no value.
    const float sink = a.sinks ? a.sinks[(h * a.G + r / a.L) * a.sinks_stride] : kNegInf;
    const float m_all = std::max(m, sink);
    // Log-sum-exp weights; a part whose scores were all -inf weighs nothing.
    float l = sink == kNegInf ? 0.0f : std::exp(sink - m_all);
    // The generic kernel's accumulator holds the largest head dim.
    float acc[D ? D : kMaxHeadDim] = {};
    for (int c = 0; c < n; ++c) {
      const PartialState p = PartialState::at(parts + c * part_size, R);
      const float w = p.m[r] == kNegInf ? 0.0f : std::exp(p.m[r] - m_all);
      l += w * p.l[r];
      axpy(acc, w, p.acc + r * Dvp, Dvp);
    }
    // A paged row whose positions all lie in blocks outside the pool has no key.
    if (l == 0.0f && !holds_key(a, b, a.row_range(len, start, r % a.L))) {
      std::fill_n(o, a.Dv, T(0.0f));
      continue;
    }
    // Otherwise l == 0 only when every score was -inf: 0/0 = NaN, as in the reference.
    const f32x8 inv = splat(1.0f / l);
    if (D != 0) {
      for (int e = 0; e < D; e += 8) {
        store8(o + e, load8(acc + e) * inv);
      }
    } else {
      for (int e = 0; e < a.Dv; ++e) {
        o[e] = static_cast<T>(acc[e] * inv[0]);
      }
    }
  }
}

template <typename T, int D>
constexpr KernelFns fns() {
  return {attend_chunk<T, D>, finalize<T, D>};
}

// The kernel of a fast head dim (kFastHeadDims), else the generic one (D = 0).
template <typename T, int... Fast>
KernelFns fns_for_head_dim(int head_dim, std::integer_sequence<int, Fast...>) {
  KernelFns f = fns<T, 0>();
  ((head_dim == Fast && (f = fns<T, Fast>(), true)) || ...);
  return f;
}

template <typename T>
KernelFns fns_for_dtype(int head_dim) {
  using Fast = std::integer_sequence<int, 32, 64, 80, 96, 112, 128, 160, 192, 256, 512>;
  static_assert(Fast::size() == std::size(kFastHeadDims), "one kernel per fast head dim");
  if constexpr (kCompiled.fast_head_dims) {
    return fns_for_head_dim<T>(head_dim, Fast{});
  } else {
    return fns<T, 0>();
  }
}

// The quantized kernels: their own for head dims 64 and 128, else the generic one.
template <typename T, int Bits>
KernelFns quantized_fns_for_dtype(int head_dim) {
  if constexpr (kCompiled.fast_head_dims) {
    if (head_dim == 64) {
      return {attend_chunk<T, 64, Bits>, finalize<T, 64>};
    }
    if (head_dim == 128) {
      return {attend_chunk<T, 128, Bits>, finalize<T, 128>};
    }
  }
  return {attend_chunk<T, 0, Bits>, finalize<T, 0>};
}

// f<T>() for the element type T of dtype.
template <typename F>
KernelFns for_dtype(Dtype dtype, F&& f) {
  switch (dtype) {
    case Dtype::float16:
      return f.template operator()<mx::float16_t>();
    case Dtype::bfloat16:
      return f.template operator()<mx::bfloat16_t>();
    case Dtype::float32:
      return f.template operator()<float>();
  }
  return {nullptr, nullptr};
}

template <typename T>
constexpr Dtype dtype_of = std::is_same_v<T, float> ? Dtype::float32
    : std::is_same_v<T, mx::float16_t>              ? Dtype::float16
                                                    : Dtype::bfloat16;

} // namespace

// Null functions for what this variant does not compile (kCompiled), whose
// templates are then never instantiated.
KernelFns quantized_kernel_fns(Dtype dtype, int head_dim, int bits) {
  return for_dtype(dtype, [&]<typename T>() -> KernelFns {
    if constexpr (kCompiled.quantized) {
      return bits == 4 ? quantized_fns_for_dtype<T, 4>(head_dim) : quantized_fns_for_dtype<T, 8>(head_dim);
    }
    return {nullptr, nullptr};
  });
}

KernelFns kernel_fns(Dtype dtype, int head_dim) {
  return for_dtype(dtype, [&]<typename T>() -> KernelFns {
    if constexpr (kCompiled.dense(dtype_of<T>)) {
      return fns_for_dtype<T>(head_dim);
    }
    return {nullptr, nullptr};
  });
}

} // namespace mlx_batched_decode::cpu::MBD_CPU_ISA
