// Argument checks shared by paged_decode_attention and its reference.
#pragma once

#include <optional>

#include "mlx/array.h"

namespace mlx_batched_decode {

namespace mx = mlx::core;

// Dimensions of a paged call (legend in paged_decode_attention.h).
struct PagedShape {
  int B, H_q, H_kv, G, L, D, num_blocks, block_size, max_blocks, T;
};

// Checks ranks, shapes, head counts, head dim, dtypes and options; throws
// std::invalid_argument whose message starts with "[paged_decode_attention]"
// and names the offending argument.
PagedShape check_paged_arguments(
    const mx::array& queries,
    const mx::array& key_pages,
    const mx::array& value_pages,
    const mx::array& block_tables,
    const mx::array& valid_lens,
    std::optional<float> scale,
    std::optional<int> window,
    const std::optional<mx::array>& sinks);

} // namespace mlx_batched_decode
