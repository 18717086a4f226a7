// Argument checks shared by ragged_decode_attention and its reference.
#pragma once

#include <optional>
#include <vector>

#include "arguments.h"

namespace mlx_batched_decode {

// Dimensions of a ragged call (legend in ragged_decode_attention.h): d.T is
// the longest T_b, lengths holds every T_b.
struct RaggedShape {
  DecodeShape d;
  std::vector<int> lengths;
};

// Checks the lists (B arrays each, [1, H_kv, T_b, D] or [H_kv, T_b, D], keys
// and values alike, one H_kv, D and dtype), then everything the dense op
// checks; throws std::invalid_argument whose message starts with
// "[ragged_decode_attention]" and names the offending argument.
RaggedShape check_ragged_arguments(const mx::array& queries, const std::vector<mx::array>& keys,
                                   const std::vector<mx::array>& values, const std::optional<mx::array>& valid_lens,
                                   const DecodeOptions& options);

// valid_lens, or every request's T_b when it is not given: integer [B].
mx::array ragged_lengths(const std::optional<mx::array>& valid_lens, const RaggedShape& r);

} // namespace mlx_batched_decode
