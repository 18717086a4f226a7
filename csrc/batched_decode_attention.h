// Padded, masked, batched decode attention: the op on dense caches.
//
// Dimension legend: B requests, H_q query heads, H_kv key/value heads
// (G = H_q / H_kv query heads share one KV head), L query rows per request,
// T padded cache length, D head dim.
#pragma once

#include "decode_options.h"
#include "mlx/array.h"
#include "mlx/utils.h"

namespace mlx_batched_decode {

// Attention of the last L tokens of each request over that request's keys.
//   queries    [B, H_q, L, D]    float16 | bfloat16 | float32
//   keys       [B, H_kv, T, D]   same dtype; any strides, read in place
//   values     [B, H_kv, T, D]   same dtype and shape as keys
//   valid_lens [B]               integer; len_b = clamp(valid_lens[b], 0, T)
//   options    scale, kv_starts, window, sinks (decode_options.h);
//              start_b = clamp(kv_starts[b], 0, T)
// Row i of request b sits at position p = len_b - L + i and attends keys
// max(start_b, p - window + 1, 0) .. p. Returns [B, H_q, L, D] in the queries'
// dtype; a row with no key gives zeros. Non-finite values in a row's range
// propagate as in a float32 softmax: a NaN score makes the row NaN, and a row
// whose scores are all -inf (with no finite sink) is 0/0 = NaN, on every
// backend. Malformed arguments throw std::invalid_argument (ValueError in Python).
mx::array batched_decode_attention(const mx::array& queries, const mx::array& keys, const mx::array& values,
                                   const mx::array& valid_lens, const DecodeOptions& options = {},
                                   mx::StreamOrDevice s = {});

// The same contract in plain MLX ops: the ground truth for tests and the
// primitive's fallback for vjp, jvp and vmap.
mx::array reference_attention(const mx::array& queries, const mx::array& keys, const mx::array& values,
                              const mx::array& valid_lens, const DecodeOptions& options = {},
                              mx::StreamOrDevice s = {});

} // namespace mlx_batched_decode
