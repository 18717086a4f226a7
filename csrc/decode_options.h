// The keyword options every op of the family takes, and the attributes its
// primitives keep of them.
//
// Dimension legend: B requests, H_q query heads, T cache positions.
#pragma once

#include <optional>
#include <tuple>

#include "mlx/array.h"

namespace mlx_batched_decode {

namespace mx = mlx::core;

// Options of a call, all optional:
//   scale      score scale, default 1/sqrt(D)
//   kv_starts  [B] integer: the first key of each request, clamped to [0, T]
//   window     >= 1: a row attends at most its last `window` keys
//   sinks      [H_q] floating: a per-head logit in every row's softmax denominator
//   ring_offset  [B] integer or a scalar (dense layout only): the cache's T
//              positions are a ring, logical position j of request b in slot
//              (j + ring_offset[b]) mod T
//   softcap    > 0: each score s = scale * q . k becomes softcap * tanh(s / softcap)
//              (Gemma 2's attention logit softcapping); sink logits are not capped
//   query_starts  [B + 1] integer: packed queries [N, H_q, D], request b's rows
//              query_starts[b] .. query_starts[b + 1] - 1 (any count, 0 included);
//              the op functions take them so and pass the primitives a view (see
//              pack_queries in arguments.h)
struct DecodeOptions {
  std::optional<float> scale;
  std::optional<mx::array> kv_starts;
  std::optional<int> window;
  std::optional<mx::array> sinks;
  std::optional<mx::array> ring_offset;
  std::optional<float> softcap;
  std::optional<mx::array> query_starts;
};

// What a primitive of the family keeps of its call (is_equivalent compares it).
struct DecodeAttributes {
  float scale;
  int window; // 0: none
  bool has_kv_starts;
  bool has_sinks;
  int group_size = 0; // quantized rows only
  int bits = 0; // quantized rows only; 0: rows of the queries' dtype
  bool has_ring_offset = false;
  float softcap = 0.0f; // 0: scores are not capped
  bool has_query_starts = false;

  auto tie() const {
    return std::tie(scale, window, has_kv_starts, has_sinks, group_size, bits, has_ring_offset, softcap,
                    has_query_starts);
  }
  bool operator==(const DecodeAttributes& o) const {
    return tie() == o.tie();
  }
};

// The window a kernel applies for T positions: `window` when it is set and
// shorter than T, else T (every window of T or more keys is no window).
inline int effective_window(int window, int T) {
  return window > 0 && window < T ? window : (T > 0 ? T : 1);
}

} // namespace mlx_batched_decode
