// Head dims of the op: every D in [1, kMaxHeadDim]; the CPU and Metal kernels
// have kernels of their own for kFastHeadDims and generic ones for the rest.
// Plain C++17: shared by the op, the CPU kernel, the Metal launch plan and the
// Linux emulation harness.
#pragma once

#include <algorithm>
#include <iterator>

namespace mlx_batched_decode {

inline constexpr int kMaxHeadDim = 512;
// Keys (and queries) may be wider than values: MLA's latent (512) and rope (64) dims.
inline constexpr int kMaxKeyHeadDim = 576;
inline constexpr int kFastHeadDims[] = {32, 64, 80, 96, 112, 128, 160, 192, 256, 512};

inline bool is_fast_head_dim(int d) {
  return std::find(std::begin(kFastHeadDims), std::end(kFastHeadDims), d) != std::end(kFastHeadDims);
}

} // namespace mlx_batched_decode
