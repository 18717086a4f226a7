// Arguments of the batched decode attention kernels, shared by the Metal
// kernels, the host launcher and the Linux emulation harness: one layout for all.
#ifndef MLX_BATCHED_DECODE_PARAMS_H
#define MLX_BATCHED_DECODE_PARAMS_H

#ifndef __METAL_VERSION__
#include <cstdint>
#endif

// Compile-time limits of the kernels, also read by the launch plan.
#define MBD_SIMD_WIDTH 32
#define MBD_MAX_SIMDGROUPS 8
// Query heads served by one threadgroup; G <= this reads each K/V row once.
#define MBD_HEADS_PER_CHUNK 8
// Function constant index of min(G, MBD_HEADS_PER_CHUNK).
#define MBD_FC_HEADS 0

namespace mlx_batched_decode {

// Strides are in elements; the last axis of every tensor is contiguous.
struct BatchedDecodeParams {
  int64_t q_batch_stride;
  int64_t q_head_stride;
  int64_t k_batch_stride;
  int64_t k_head_stride;
  int64_t k_seq_stride;
  int64_t v_batch_stride;
  int64_t v_head_stride;
  int64_t v_seq_stride;
  int64_t lens_stride;  // valid_lens may be a strided or broadcast view
  int num_q_heads;   // H_q
  int gqa_factor;    // G = H_q / H_kv
  int head_chunks;   // ceil(G / MBD_HEADS_PER_CHUNK)
  int seq_len;       // T, the bound every length is clamped to
  int num_splits;    // sequence chunks of split-K; 1 = single pass
  int split_len;     // keys per split
  float scale;
};

} // namespace mlx_batched_decode

#endif
