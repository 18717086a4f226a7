// Argument checks shared by the op and its reference.
#pragma once

#include <optional>

#include "mlx/array.h"

namespace mlx_batched_decode {

namespace mx = mlx::core;

struct DecodeShape {
  int B, H_q, H_kv, G, T, D;
};

// Checks ranks, shapes, head counts, head dim and dtypes of a call and returns
// its dimensions; throws std::invalid_argument whose message starts with
// "[batched_decode_attention]" and names the offending argument.
DecodeShape check_arguments(
    const mx::array& queries,
    const mx::array& keys,
    const mx::array& values,
    const mx::array& valid_lens,
    std::optional<float> scale);

// The scale to use: the given one or 1/sqrt(D).
float resolve_scale(std::optional<float> scale, int head_dim);

} // namespace mlx_batched_decode
