// The reference's core, shared by reference_attention and
// reference_paged_attention (not a public API).
#pragma once

#include <optional>

#include "decode_options.h"
#include "mlx/array.h"
#include "mlx/utils.h"

namespace mlx_batched_decode {

// reference_attention on checked arguments, where key_mask (bool [B, T]), if
// given, also removes keys from every row's range (a paged cache's positions
// whose block lies outside the pool). With options.query_starts the queries
// are request_queries' view [B, H_q, N, D] and the result [N, H_q, D].
mx::array masked_reference_attention(const mx::array& queries, const mx::array& keys, const mx::array& values,
                                     const mx::array& valid_lens, const DecodeOptions& options,
                                     const std::optional<mx::array>& key_mask, mx::StreamOrDevice s);

} // namespace mlx_batched_decode
