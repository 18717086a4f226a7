// Decode attention straight from one cache buffer per request (SGLang's MLX
// backend, mlx-lm's single-request KVCache): batched_decode_attention's
// semantics on B arrays of their own lengths, read in place.
//
// Dimension legend: B requests, H_q query heads, H_kv key/value heads
// (G = H_q / H_kv), L query rows per request, T_b request b's positions,
// D head dim.
#pragma once

#include <optional>
#include <vector>

#include "decode_options.h"
#include "mlx/array.h"
#include "mlx/utils.h"

namespace mlx_batched_decode {

// Attention of the last L tokens of each request over its own keys.
//   queries    [B, H_q, L, D]                        float16 | bfloat16 | float32
//   keys       B arrays [1, H_kv, T_b, D] or [H_kv, T_b, D] (mixed freely); one
//              dtype, the queries'; any strides, read in place; T_b may be 0
//   values     B arrays, each the shape of request b's keys
//   valid_lens [B] integer, default T_b; len_b = clamp(valid_lens[b], 0, T_b)
//   options    scale, kv_starts, window, sinks as batched_decode_attention
// Returns [B, H_q, L, D] in the queries' dtype; a row with no key gives zeros.
// Malformed arguments throw std::invalid_argument (ValueError in Python).
mx::array ragged_decode_attention(const mx::array& queries, const std::vector<mx::array>& keys,
                                  const std::vector<mx::array>& values,
                                  const std::optional<mx::array>& valid_lens = std::nullopt,
                                  const DecodeOptions& options = {}, mx::StreamOrDevice s = {});

// The same contract in plain MLX ops, reference_attention on each request's
// own arrays: ground truth for tests and the primitive's fallback.
mx::array reference_ragged_attention(const mx::array& queries, const std::vector<mx::array>& keys,
                                     const std::vector<mx::array>& values,
                                     const std::optional<mx::array>& valid_lens = std::nullopt,
                                     const DecodeOptions& options = {}, mx::StreamOrDevice s = {});

} // namespace mlx_batched_decode
