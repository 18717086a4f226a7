// Argument checks shared by paged_decode_attention and its reference.
#pragma once

#include "arguments.h"

namespace mlx_batched_decode {

// Dimensions of a paged call (legend in paged_decode_attention.h); d.T is
// max_blocks * block_size.
struct PagedShape {
  DecodeShape d;
  int num_blocks, block_size, max_blocks;
};

// Checks ranks, shapes, head counts, head dim, dtypes and options; throws
// std::invalid_argument whose message starts with "[paged_decode_attention]"
// and names the offending argument.
PagedShape check_paged_arguments(const mx::array& queries, const mx::array& key_pages, const mx::array& value_pages,
                                 const mx::array& block_tables, const mx::array& valid_lens,
                                 const DecodeOptions& options);

} // namespace mlx_batched_decode
