// Batched decode attention over quantized keys and values (mx.quantize's
// affine format).
//
// Dimension legend: B requests, H_q query heads, H_kv key/value heads
// (G = H_q / H_kv), L query rows per request, T padded cache length, D head
// dim of queries and keys, Dv of values, W = D * bits / 32 packed words per
// row, S = D / group_size groups per row (Wv and Sv of Dv for values).
#pragma once

#include <vector>

#include "decode_options.h"
#include "mlx/array.h"
#include "mlx/utils.h"

namespace mlx_batched_decode {

// batched_decode_attention on keys and values stored as the triples
// (packed, scales, biases) that mx.quantize(x, group_size, bits) returns:
//   queries    [B, H_q, L, D]    float16 | bfloat16 | float32
//   keys       (packed uint32 [B, H_kv, T, W], scales [B, H_kv, T, S],
//               biases [B, H_kv, T, S]); scales and biases float16, bfloat16
//               or float32, any strides (views are read in place)
//   values     the same layout and scale dtype as keys, of a head dim Dv of their own
//              (words [B, H_kv, T, Wv], scales and biases [B, H_kv, T, Sv])
//   group_size 32, 64 or 128, dividing D and Dv (D <= 576, Dv <= 512); bits 4 or 8
//   options    scale, kv_starts, window, sinks as batched_decode_attention
// The rest as batched_decode_attention. Element e of a row is
// scales[e / group_size] * q_e + biases[e / group_size], q_e the bits-wide
// unsigned integer at bit (e % (32 / bits)) * bits of word e / (32 / bits).
// Returns [B, H_q, L, Dv] in the queries' dtype, accumulated in float32.
mx::array quantized_batched_decode_attention(const mx::array& queries, const std::vector<mx::array>& keys,
                                             const std::vector<mx::array>& values, const mx::array& valid_lens,
                                             int group_size = 64, int bits = 8, const DecodeOptions& options = {},
                                             mx::StreamOrDevice s = {});

} // namespace mlx_batched_decode
