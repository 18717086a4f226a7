// Launch plan of the quantized decode attention Metal kernel: the dense
// kernel's plan (grid, splits, rows per threadgroup and its reduce pass: the
// core is one) with the quantized main kernel, and its extra arguments. Plain
// C++17, shared with the Linux emulation harness.
#pragma once

#include <cstdint>
#include <stdexcept>
#include <string>

#include "../kernels/quantized_batched_decode_attention_params.h"
#include "launch_plan.h"

namespace mlx_batched_decode {

/** Host name of the quantized main kernel of (D, Dv; value_dim 0: Dv = D):
 * "quantized_batched_decode_attention_float16_128_8bit", "..._float16_576_v512_4bit". */
inline std::string quantized_kernel_name(KernelDtype dtype, int head_dim, int value_dim, int bits) {
  return "quantized_batched_decode_attention_" + kernel_suffix(dtype, head_dim, value_dim) + "_" +
      std::to_string(bits) + "bit";
}

/** The launch of both passes for packed keys and values of `bits` in groups of `group_size`. */
inline LaunchPlan make_quantized_launch_plan(const LaunchShape& s, const ThreadLimits& limits, int bits,
                                             int group_size) {
  const std::string prefix = "[quantized_batched_decode_attention] ";
  if (bits != 4 && bits != 8) {
    throw std::invalid_argument(prefix + "bits must be 4 or 8");
  }
  if (group_size != 32 && group_size != 64 && group_size != 128) {
    throw std::invalid_argument(prefix + "group_size must be 32, 64 or 128");
  }
  const int dv = value_head_dim(s);
  if (s.head_dim > kMaxKeyHeadDim || dv > kMaxHeadDim) {
    throw std::invalid_argument(prefix + "head dims of at most " + std::to_string(kMaxKeyHeadDim) +
                                " (keys) and " + std::to_string(kMaxHeadDim) + " (values) are supported");
  }
  if (s.head_dim % group_size != 0 || dv % group_size != 0) {
    throw std::invalid_argument(prefix + "head dims " + std::to_string(s.head_dim) + " and " + std::to_string(dv) +
                                " are not both multiples of group_size");
  }
  // The quantized rows have no tiled path: their packed words are read a word per lane.
  LaunchPlan p = make_launch_plan(s, limits, false);
  p.kernel = quantized_kernel_name(s.dtype, s.head_dim, dv, bits);
  return p;
}

/** Strides (in elements) of the scales and biases of keys ([0]) and values ([1]): batch, head, position, group. */
struct QuantizedStrides {
  int64_t scales[2][4];
  int64_t biases[2][4];
};

/** Kernel arguments of the quantized rows; strides of size-1 axes (never stepped along) set to 0. */
inline QuantizedDecodeParams make_quantized_params(const LaunchShape& s, const QuantizedStrides& strides,
                                                   int group_size, KernelDtype scales_dtype) {
  QuantizedDecodeParams q{};
  for (int side = 0; side < 2; ++side) {
    const int dim = side ? value_head_dim(s) : s.head_dim;
    const int sizes[4] = {s.batch, s.num_kv_heads, s.seq_len, dim / group_size};
    for (int axis = 0; axis < 4; ++axis) {
      q.scales_stride[side][axis] = sizes[axis] > 1 ? strides.scales[side][axis] : 0;
      q.biases_stride[side][axis] = sizes[axis] > 1 ? strides.biases[side][axis] : 0;
    }
  }
  q.group_size = group_size;
  q.scales_dtype = int(scales_dtype);
  return q;
}

/** Whether the quantized main kernel loads whole query vectors: packed rows are read a word per lane. */
inline bool quantized_vector_loads(const LaunchShape& s, const LaunchPlan& plan, const InputStrides& strides,
                                   int64_t query_offset) {
  InputStrides st = strides;
  st.k_batch = st.k_head = st.k_seq = st.v_batch = st.v_head = st.v_seq = 0;
  return vector_loads(s, plan, st, InputOffsets{query_offset, 0, 0});
}

} // namespace mlx_batched_decode
