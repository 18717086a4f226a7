// The CPU decode attention kernel. This file is compiled once per instruction
// set (see CMakeLists.txt); MBD_CPU_ISA names the namespace of each copy.
#include <algorithm>
#include <cmath>
#include <limits>
#include <type_traits>
#include <vector>

#include "cpu/convert.h"
#include "cpu/decode_args.h"
#include "cpu/kernel_table.h"
#include "cpu/tiles.h"
#include "cpu/vector_math.h"

namespace mlx_batched_decode::cpu::MBD_CPU_ISA {

namespace {

// Keys scored before the accumulator is rescaled: one rescale per block
// instead of one per key. A multiple of 8, the width of softmax_block.
constexpr int kBlock = 32;
constexpr float kNegInf = -std::numeric_limits<float>::infinity();

// Keys scored with the AVX512_BF16 dot product: bfloat16 rows in a variant
// compiled for it. Their queries stay unscaled in bfloat16 (q_raw), exact, and
// the scale is applied to the scores.
#if defined(__AVX512BF16__) && defined(__AVX512VL__)
template <typename T>
constexpr bool kBf16Dot = std::is_same_v<T, mx::bfloat16_t>;
#else
template <typename T>
constexpr bool kBf16Dot = false;
#endif

// Per-thread scratch, one per row type: scaled queries [G, D] (or unscaled
// ones in T, q_raw, for kBf16Dot), scores [G, kBlock], the softmax rescale
// factors of a block [G] and a block of key or value rows [kBlock, D]
// gathered from a strided last axis.
template <typename T>
struct Scratch {
  std::vector<float> q;
  std::vector<T> q_raw;
  std::vector<float> scores;
  std::vector<float> alpha;
  std::vector<T> block;

  void reserve(int G, int D) {
    grow(q, static_cast<size_t>(G) * D);
    if constexpr (kBf16Dot<T>) {
      grow(q_raw, static_cast<size_t>(G) * D);
    }
    grow(scores, static_cast<size_t>(G) * kBlock);
    grow(alpha, static_cast<size_t>(G));
    grow(block, static_cast<size_t>(kBlock) * D);
  }

  template <typename V>
  static void grow(std::vector<V>& v, size_t n) {
    if (v.size() < n) {
      v.resize(n);
    }
  }
};

template <typename T>
thread_local Scratch<T> tls_scratch;

// Points rows[j] at position t + j of a [T, D] head, for j < n: in place
// when the last axis is contiguous, else gathered into block. Rows n to the
// next multiple of 4 repeat row n - 1, so the scoring can run on whole groups
// of four; their scores are never read.
template <typename T, int D>
void load_block(const T* head, const int64_t* stride, int t, int n, T* block, const T** rows) {
  for (int j = 0; j < n; ++j) {
    const T* row = head + (t + j) * stride[2];
    if (stride[3] == 1) {
      rows[j] = row;
      continue;
    }
    for (int i = 0; i < D; ++i) {
      block[j * D + i] = row[i * stride[3]];
    }
    rows[j] = block + j * D;
  }
  for (int j = n; j % 4 != 0; ++j) {
    rows[j] = rows[n - 1];
  }
}

// Requests rows [0, n) of a [n, D] block with the given row stride into L2.
template <typename T, int D>
void prefetch_rows(const T* first, int64_t row_stride, int n) {
  for (int j = 0; j < n; ++j) {
    const char* row = reinterpret_cast<const char*>(first + j * row_stride);
    for (int byte = 0; byte < D * static_cast<int>(sizeof(T)); byte += 64) {
      __builtin_prefetch(row + byte, 0, 1);
    }
  }
}

// The rows to request while block [t, t + n) of chunk c runs: the next block
// of c, else the first block of the chunk this thread runs next, so that short
// chunks do not each start cold. Gathered rows (strided last axis) have no
// fixed successor offset and are not requested.
inline Lookahead successor_rows(const int64_t* stride, const Chunk& c, int t, int n, const Chunk* next) {
  if (stride[3] != 1) {
    return {};
  }
  if (t + n < c.t1) {
    return {kBlock * stride[2], std::min(kBlock, c.t1 - t - n)};
  }
  if (next == nullptr || next->t1 <= next->t0) {
    return {};
  }
  const int64_t offset = int64_t{next->b - c.b} * stride[0] + int64_t{next->h - c.h} * stride[1] +
      int64_t{next->t0 - t} * stride[2];
  return {offset, std::min(kBlock, next->t1 - next->t0)};
}

// Covers heads [0, G) with tiles of up to MaxH (4 or 2) heads: calls
// tile.template operator()<H>(g) for as many tiles of MaxH as fit, then one
// of 2 and one of 1 as the rest needs. Only the first tile (g == 0) requests
// the next rows, since all tiles read the same rows.
template <int MaxH, typename Tile>
inline void for_head_tiles(int G, Tile&& tile) {
  static_assert(MaxH == 2 || MaxH == 4);
  int g = 0;
  for (; g + MaxH <= G; g += MaxH) {
    tile.template operator()<MaxH>(g);
  }
  if constexpr (MaxH == 4) {
    if (g + 2 <= G) {
      tile.template operator()<2>(g);
      g += 2;
    }
  }
  if (g < G) {
    tile.template operator()<1>(g);
  }
}

template <typename T, int D>
void attend_chunk(const DecodeArgs& a, const Chunk& c, PartialState st, const Chunk* next) {
  const int b = c.b, h = c.h, t0 = c.t0, t1 = c.t1;
  const int G = a.G;
  Scratch<T>& s = tls_scratch<T>;
  s.reserve(G, D);
  float* qs = s.q.data();
  float* scores = s.scores.data();
  float* alpha = s.alpha.data();

  const T* q = static_cast<const T*>(a.queries) + b * a.q_stride[0];
  for (int g = 0; g < G; ++g) {
    const T* qr = q + static_cast<int64_t>(h * G + g) * a.q_stride[1];
    if constexpr (kBf16Dot<T>) {
      for (int i = 0; i < D; ++i) {
        s.q_raw[g * D + i] = qr[i * a.q_stride[2]];
      }
    } else if (a.q_stride[2] == 1) {
      for (int i = 0; i < D; i += 8) {
        store8(qs + g * D + i, load8(qr + i) * splat(a.scale));
      }
    } else {
      for (int i = 0; i < D; ++i) {
        qs[g * D + i] = static_cast<float>(qr[i * a.q_stride[2]]) * a.scale;
      }
    }
    st.m[g] = kNegInf;
    st.l[g] = 0.0f;
    std::fill_n(st.acc + g * D, D, 0.0f);
  }

  const T* kh = static_cast<const T*>(a.keys) + b * a.k_stride[0] + h * a.k_stride[1];
  const T* vh = static_cast<const T*>(a.values) + b * a.v_stride[0] + h * a.v_stride[1];
  T* block = s.block.data();
  const T* rows[kBlock];
  // The first block's values are requested while its keys are scored, in case
  // no previous chunk requested them.
  if (a.v_stride[3] == 1) {
    prefetch_rows<T, D>(vh + t0 * a.v_stride[2], a.v_stride[2], std::min(kBlock, t1 - t0));
  }
  for (int t = t0; t < t1; t += kBlock) {
    const int n = std::min(kBlock, t1 - t);
    // The next rows are requested from memory while this block is computed:
    // hardware prefetchers stop at each 4 KiB page.
    const Lookahead k_next = successor_rows(a.k_stride, c, t, n, next);
    const Lookahead v_next = successor_rows(a.v_stride, c, t, n, next);

    // Each key row is read once and scored against all G query heads, two at a
    // time (four with the bfloat16 dot product).
    load_block<T, D>(kh, a.k_stride, t, n, block, rows);
    for (int j = 0; j < n; j += 4) {
      const Lookahead ahead{k_next.offset, k_next.rows - j};
#if defined(__AVX512BF16__) && defined(__AVX512VL__)
      if constexpr (kBf16Dot<T>) {
        for_head_tiles<4>(G, [&]<int H>(int g) {
          dot_4_rows_bf16<D, H>(s.q_raw.data() + g * D, rows + j, scores + g * kBlock + j, kBlock, a.scale,
                                g == 0 ? ahead : Lookahead{});
        });
        continue;
      }
#endif
      for_head_tiles<2>(G, [&]<int H>(int g) {
        dot_4_rows<D, H>(qs + g * D, rows + j, scores + g * kBlock + j, kBlock, g == 0 ? ahead : Lookahead{});
      });
    }

    for (int g = 0; g < G; ++g) {
      alpha[g] = softmax_block(scores + g * kBlock, n, st.m[g], st.l[g]);
    }

    // Value rows in tiles of up to four heads, each row chunk loaded once per tile.
    load_block<T, D>(vh, a.v_stride, t, n, block, rows);
    for_head_tiles<4>(G, [&]<int H>(int g) {
      accumulate_rows<D, H>(st.acc + g * D, alpha + g, scores + g * kBlock, kBlock, rows, n, g == 0 ? v_next : Lookahead{});
    });
  }
}

template <typename T, int D>
void finalize(const DecodeArgs& a, int b, int h, float* parts, int n) {
  const int G = a.G;
  const int64_t part_size = PartialState::size(G, D);
  T* out = static_cast<T*>(a.out) + (static_cast<int64_t>(b) * a.H_q + h * G) * D;
  for (int g = 0; g < G; ++g) {
    T* o = out + g * D;
    if (n == 0) {
      std::fill_n(o, D, T(0.0f));
      continue;
    }
    float m = kNegInf;
    for (int c = 0; c < n; ++c) {
      m = std::max(m, PartialState::at(parts + c * part_size, G, D).m[g]);
    }
    // Log-sum-exp weights; a part whose scores were all -inf weighs nothing.
    float l = 0.0f;
    float acc[D] = {};
    for (int c = 0; c < n; ++c) {
      const PartialState p = PartialState::at(parts + c * part_size, G, D);
      const float w = p.m[g] == kNegInf ? 0.0f : std::exp(p.m[g] - m);
      l += w * p.l[g];
      axpy<D>(acc, w, p.acc + g * D);
    }
    // l == 0 only when every score was -inf: 0/0 = NaN, as in the reference.
    const f32x8 inv = splat(1.0f / l);
    for (int i = 0; i < D; i += 8) {
      store8(o + i, load8(acc + i) * inv);
    }
  }
}

template <typename T>
KernelFns fns_for_dtype(int head_dim) {
  switch (head_dim) {
    case 64:
      return {attend_chunk<T, 64>, finalize<T, 64>};
    case 80:
      return {attend_chunk<T, 80>, finalize<T, 80>};
    case 96:
      return {attend_chunk<T, 96>, finalize<T, 96>};
    case 128:
      return {attend_chunk<T, 128>, finalize<T, 128>};
    case 256:
      return {attend_chunk<T, 256>, finalize<T, 256>};
    default:
      return {nullptr, nullptr};
  }
}

} // namespace

KernelFns kernel_fns(Dtype dtype, int head_dim) {
  switch (dtype) {
    case Dtype::float16:
      return fns_for_dtype<mx::float16_t>(head_dim);
    case Dtype::bfloat16:
      return fns_for_dtype<mx::bfloat16_t>(head_dim);
    case Dtype::float32:
      return fns_for_dtype<float>(head_dim);
  }
  return {nullptr, nullptr};
}

} // namespace mlx_batched_decode::cpu::MBD_CPU_ISA
