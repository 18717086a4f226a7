// Launch plan of the batched decode attention Metal kernels. Plain C++17 so
// that the Metal launcher and the Linux emulation harness dispatch the kernels
// in exactly the same way. Shapes only: lengths stay on the device.
#pragma once

#include <algorithm>
#include <cstdint>
#include <stdexcept>
#include <string>

#include "../kernels/batched_decode_attention_params.h"

namespace mlx_batched_decode {

enum class KernelDtype { float16, bfloat16, float32 };

/** Shapes a launch depends on. B, H_q, H_kv, T, D as in the op's contract. */
struct LaunchShape {
  int batch;                 // B
  int num_q_heads;           // H_q
  int num_kv_heads;          // H_kv
  int seq_len;               // T (capacity of the K/V views, not a length)
  int head_dim;              // D
  KernelDtype dtype;
  int max_threads_per_group; // the pipeline's maxTotalThreadsPerThreadgroup
};

struct Size3 {
  uint64_t x, y, z;
};

/** Buffer indices; equal to the kernels' [[buffer(i)]]. */
enum BufferIndex : int {
  kQueries = 0,
  kKeys = 1,
  kValues = 2,
  kValidLens = 3,
  kOut = 4,
  kPartialAcc = 5,
  kPartialMax = 6,
  kPartialSum = 7,
  kParams = 8,
};

struct LaunchPlan {
  std::string kernel;        // main pass, one threadgroup per (split, KV head x chunk, request)
  std::string reduce_kernel; // split-K merge; empty when num_splits == 1
  Size3 grid;                // threadgroups of the main pass
  Size3 group;               // threads per threadgroup of the main pass
  Size3 reduce_grid;         // threadgroups of the reduction: (1, H_q, B)
  Size3 reduce_group;
  int num_splits;
  int split_len;
  int head_chunks;
  int heads_per_group;       // function constant MBD_FC_HEADS of the main pass
  int vector_width;          // elements per vector load: K/V/Q strides must be multiples
  uint64_t partial_acc_elems;   // float32 [B, H_q, splits, D]; 0 when single pass
  uint64_t partial_stats_elems; // float32 [B, H_q, splits] for max and for sum
};

// Split-K aims for this many threadgroups (a few per GPU core on Apple silicon).
constexpr int kTargetThreadgroups = 128;
// Fewer keys per split would make the reduction cost more than it saves.
constexpr int kMinKeysPerSplit = 64;
constexpr int kMaxSplits = 64;

inline const char* dtype_name(KernelDtype dtype) {
  switch (dtype) {
    case KernelDtype::float16:
      return "float16";
    case KernelDtype::bfloat16:
      return "bfloat16";
    case KernelDtype::float32:
      return "float32";
  }
  throw std::invalid_argument("[batched_decode_attention] unknown dtype");
}

inline bool is_supported_head_dim(int d) {
  return d == 64 || d == 80 || d == 96 || d == 128 || d == 256;
}

/** Elements per vector load for head dim D; mirrors the kernel's choice. */
inline int vector_width(int head_dim) {
  return head_dim % 128 == 0 ? 4 : 2;
}

inline int ceil_div(int a, int b) {
  return (a + b - 1) / b;
}

/** The launch of both passes, from shapes and the device's thread limit. */
inline LaunchPlan make_launch_plan(const LaunchShape& s) {
  const char* prefix = "[batched_decode_attention] ";
  if (s.batch < 1 || s.num_q_heads < 1 || s.num_kv_heads < 1 || s.seq_len < 0) {
    throw std::invalid_argument(std::string(prefix) + "B, H_q and H_kv must be positive and T >= 0");
  }
  if (s.num_q_heads % s.num_kv_heads != 0) {
    throw std::invalid_argument(std::string(prefix) + "H_q must be a multiple of H_kv");
  }
  if (!is_supported_head_dim(s.head_dim)) {
    throw std::invalid_argument(
        std::string(prefix) + "head dim " + std::to_string(s.head_dim) +
        " has no Metal kernel (64, 80, 96, 128, 256)");
  }
  if (s.max_threads_per_group < MBD_SIMD_WIDTH) {
    throw std::invalid_argument(
        std::string(prefix) + "the pipeline allows " +
        std::to_string(s.max_threads_per_group) + " threads per threadgroup, the kernel needs " +
        std::to_string(MBD_SIMD_WIDTH));
  }
  LaunchPlan p{};
  const std::string suffix = std::string(dtype_name(s.dtype)) + "_" + std::to_string(s.head_dim);
  p.kernel = "batched_decode_attention_" + suffix;
  p.vector_width = vector_width(s.head_dim);

  const int gqa = s.num_q_heads / s.num_kv_heads;
  p.head_chunks = ceil_div(gqa, MBD_HEADS_PER_CHUNK);
  p.heads_per_group = std::min(gqa, MBD_HEADS_PER_CHUNK);
  const int simdgroups =
      std::min(MBD_MAX_SIMDGROUPS, s.max_threads_per_group / MBD_SIMD_WIDTH);

  // Split the sequence only when (request, KV head, chunk) items can't fill the GPU.
  const int64_t items = int64_t(s.batch) * s.num_kv_heads * p.head_chunks;
  int splits = 1;
  if (items < kTargetThreadgroups) {
    splits = int(std::max<int64_t>(1, std::min<int64_t>(
        {(kTargetThreadgroups + items - 1) / items,
         int64_t(s.seq_len / kMinKeysPerSplit),
         int64_t(kMaxSplits)})));
  }
  p.split_len = std::max(1, ceil_div(s.seq_len, splits));
  // Recount so that no split starts at or past T.
  p.num_splits = std::max(1, ceil_div(s.seq_len, p.split_len));

  p.grid = {uint64_t(p.num_splits), uint64_t(s.num_kv_heads) * p.head_chunks, uint64_t(s.batch)};
  p.group = {uint64_t(simdgroups) * MBD_SIMD_WIDTH, 1, 1};
  if (p.num_splits > 1) {
    p.reduce_kernel = "batched_decode_attention_reduce_" + suffix;
    p.reduce_grid = {1, uint64_t(s.num_q_heads), uint64_t(s.batch)};
    const int reduce_threads = std::min(
        ceil_div(s.head_dim, MBD_SIMD_WIDTH) * MBD_SIMD_WIDTH,
        s.max_threads_per_group / MBD_SIMD_WIDTH * MBD_SIMD_WIDTH);
    p.reduce_group = {uint64_t(reduce_threads), 1, 1};
    p.partial_stats_elems = uint64_t(s.batch) * s.num_q_heads * p.num_splits;
    p.partial_acc_elems = p.partial_stats_elems * s.head_dim;
  }
  return p;
}

/** Strides (in elements) of queries [B,H_q,1,D], keys/values [B,H_kv,T,D], valid_lens [B]. */
struct InputStrides {
  int64_t q_batch, q_head;
  int64_t k_batch, k_head, k_seq;
  int64_t v_batch, v_head, v_seq;
  int64_t lens;
};

/** Kernel arguments for a plan; throws when a stride breaks the vector loads. */
inline BatchedDecodeParams make_params(
    const LaunchShape& s,
    const LaunchPlan& plan,
    const InputStrides& strides,
    float scale) {
  // A size-1 axis is never stepped along, whatever stride the view reports.
  InputStrides st = strides;
  if (s.batch == 1) {
    st.q_batch = st.k_batch = st.v_batch = st.lens = 0;
  }
  if (s.num_q_heads == 1) {
    st.q_head = 0;
  }
  if (s.num_kv_heads == 1) {
    st.k_head = st.v_head = 0;
  }
  if (s.seq_len <= 1) {
    st.k_seq = st.v_seq = 0;
  }
  const int64_t all[] = {st.q_batch, st.q_head, st.k_batch, st.k_head,
                         st.k_seq,   st.v_batch, st.v_head, st.v_seq};
  for (int64_t v : all) {
    if (v % plan.vector_width != 0) {
      throw std::invalid_argument(
          "[batched_decode_attention] strides must be multiples of " +
          std::to_string(plan.vector_width) + " elements for the Metal kernel");
    }
  }
  BatchedDecodeParams p{};
  p.q_batch_stride = st.q_batch;
  p.q_head_stride = st.q_head;
  p.k_batch_stride = st.k_batch;
  p.k_head_stride = st.k_head;
  p.k_seq_stride = st.k_seq;
  p.v_batch_stride = st.v_batch;
  p.v_head_stride = st.v_head;
  p.v_seq_stride = st.v_seq;
  p.lens_stride = st.lens;
  p.num_q_heads = s.num_q_heads;
  p.gqa_factor = s.num_q_heads / s.num_kv_heads;
  p.head_chunks = plan.head_chunks;
  p.seq_len = s.seq_len;
  p.num_splits = plan.num_splits;
  p.split_len = plan.split_len;
  p.scale = scale;
  return p;
}

} // namespace mlx_batched_decode
