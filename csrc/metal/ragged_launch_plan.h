// Launch plan of the ragged decode attention Metal kernel (one buffer per
// request): the dense plan (grid, splits, rows per threadgroup, the reduce over
// all B) with the ragged main kernel, whose main pass is dispatched in groups
// of requests whose buffers fit the kernel's MBD_RAGGED_SLOTS slots, and the
// request table those dispatches read. Plain C++17, shared with the Linux
// emulation harness, so that both bind and dispatch the same groups.
//
// Metal binds at most 31 buffers per dispatch, and MLX 0.32's command encoder
// gives no useResource for an argument buffer of addresses: each buffer a
// dispatch reads is bound, so the groups are what the binding limit allows.
#pragma once

#include <cstdint>
#include <stdexcept>
#include <string>
#include <vector>

#include "../kernels/ragged_decode_attention_params.h"
#include "launch_plan.h"

namespace mlx_batched_decode {

/** Buffer indices of the ragged kernel past kParams; equal to its [[buffer(i)]]. */
enum RaggedBufferIndex : int {
  kRequests = MBD_RAGGED_REQUESTS,
  kRaggedGroup = MBD_RAGGED_GROUP,
  kRaggedSlot0 = MBD_RAGGED_SLOT0,
};
constexpr int kRaggedSlots = MBD_RAGGED_SLOTS;

/** Host name of the ragged main kernel: "ragged_decode_attention_float16_128". */
inline std::string ragged_kernel_name(KernelDtype dtype, int head_dim, int value_dim = 0) {
  return "ragged_decode_attention_" + kernel_suffix(dtype, head_dim, value_dim);
}

/** The launch of both passes; s.seq_len is the longest T_b. The grid's z is B: each group
 * dispatches its own requests (ragged_group_grid). */
inline LaunchPlan make_ragged_launch_plan(const LaunchShape& s, const ThreadLimits& limits) {
  LaunchPlan p = make_launch_plan(s, limits);
  p.kernel = ragged_kernel_name(s.dtype, s.head_dim, value_head_dim(s));
  return p;
}

/** One request's keys or values as the host holds them. */
struct RaggedArray {
  const void* buffer;   // the buffer holding it: arrays of one buffer share a slot
  int64_t byte_offset;  // of its first element from the buffer's start
  int64_t head_stride;  // in elements
  int64_t seq_stride;
};

/**
 * One dispatch of the main pass: requests first .. first + count - 1, whose
 * buffers are bound at kRaggedSlot0 + i for each slots[i]: the index, among the
 * keys (0 .. B-1) and then the values (B .. 2B-1), of the first array of that
 * buffer. A request of no positions binds nothing.
 */
struct RaggedGroup {
  int first;
  int count;
  std::vector<int> slots;
};

struct RaggedLayout {
  std::vector<RaggedRequest> table; // [B], bound at kRequests in both passes
  std::vector<RaggedGroup> groups;  // in request order, covering all B
};

/**
 * The table and groups of B requests: keys[b] and values[b] of lengths[b] >= 0
 * positions (T_b), elements of `itemsize` bytes, H_kv heads. Requests join the
 * current group while its distinct buffers fit `slots`. Strides of size-1 axes
 * (never stepped along) are set to 0, as effective_strides does.
 */
inline RaggedLayout make_ragged_layout(const std::vector<RaggedArray>& keys, const std::vector<RaggedArray>& values,
                                       const std::vector<int>& lengths, int num_kv_heads, int itemsize,
                                       int slots = kRaggedSlots) {
  const std::string prefix = "[ragged_decode_attention] ";
  const int B = int(lengths.size());
  if (int(keys.size()) != B || int(values.size()) != B) {
    throw std::invalid_argument(prefix + "keys, values and lengths must hold B entries each");
  }
  if (slots < 2 || slots > kRaggedSlots) {
    throw std::invalid_argument(prefix + "a group binds 2 to " + std::to_string(kRaggedSlots) + " buffers");
  }
  RaggedLayout out;
  out.table.resize(B);
  std::vector<const void*> bound; // the current group's buffers, by slot
  const auto slot_of = [&](const void* buffer) {
    for (int i = 0; i < int(bound.size()); ++i) {
      if (bound[i] == buffer) {
        return i;
      }
    }
    return -1;
  };
  for (int b = 0; b < B; ++b) {
    if (lengths[b] < 0) {
      throw std::invalid_argument(prefix + "request " + std::to_string(b) + " has a negative length");
    }
    RaggedRequest& r = out.table[b];
    r.length = lengths[b];
    if (r.length > 0) {
      const RaggedArray* sides[2] = {&keys[b], &values[b]};
      const int needed = int(slot_of(keys[b].buffer) < 0) +
          int(slot_of(values[b].buffer) < 0 && values[b].buffer != keys[b].buffer);
      if (out.groups.empty() || int(bound.size()) + needed > slots) {
        out.groups.push_back({b, 0, {}});
        bound.clear();
      }
      int slot[2];
      int64_t offset[2], head[2], seq[2];
      for (int side = 0; side < 2; ++side) {
        const RaggedArray& a = *sides[side];
        if (a.byte_offset % itemsize != 0) {
          throw std::invalid_argument(prefix + (side ? "values[" : "keys[") + std::to_string(b) + "] starts " +
                                      std::to_string(a.byte_offset) + " bytes into its buffer, between elements");
        }
        slot[side] = slot_of(a.buffer);
        if (slot[side] < 0) {
          slot[side] = int(bound.size());
          bound.push_back(a.buffer);
          out.groups.back().slots.push_back(side * B + b);
        }
        offset[side] = a.byte_offset / itemsize;
        head[side] = num_kv_heads > 1 ? a.head_stride : 0;
        seq[side] = r.length > 1 ? a.seq_stride : 0;
      }
      r.k_slot = slot[0];
      r.v_slot = slot[1];
      r.k_offset = offset[0];
      r.v_offset = offset[1];
      r.k_head_stride = head[0];
      r.v_head_stride = head[1];
      r.k_seq_stride = seq[0];
      r.v_seq_stride = seq[1];
    } else if (out.groups.empty()) {
      out.groups.push_back({b, 0, {}});
    }
    ++out.groups.back().count;
  }
  return out;
}

/** The main pass's grid of one group: the plan's, over the group's requests (packed queries:
 * every row block, those of other groups' requests returning at once). */
inline Size3 ragged_group_grid(const LaunchPlan& plan, const RaggedGroup& group) {
  return {plan.grid.x, plan.grid.y, plan.packed_queries ? 1 : uint64_t(group.count)};
}

/** `strides` with the keys' and values' (which the table holds per request) set to 0. */
inline InputStrides without_kv_strides(InputStrides strides) {
  strides.k_batch = strides.k_head = strides.k_seq = 0;
  strides.v_batch = strides.v_head = strides.v_seq = 0;
  return strides;
}

/**
 * Whether the ragged main kernel loads whole vectors: the queries as
 * vector_loads decides, and every request's rows on the vector width (its
 * offsets and strides; slots are bound at their buffers' starts, which Metal
 * aligns to at least 16 bytes). Requests of no positions are never read.
 */
inline bool ragged_vector_loads(const LaunchShape& s, const LaunchPlan& plan, const InputStrides& strides,
                                int64_t query_offset, const RaggedLayout& layout) {
  if (!vector_loads(s, plan, without_kv_strides(strides), InputOffsets{query_offset, 0, 0})) {
    return false;
  }
  for (const RaggedRequest& r : layout.table) {
    const int64_t elements[] = {r.k_offset,      r.v_offset,      r.k_head_stride,
                                r.v_head_stride, r.k_seq_stride,  r.v_seq_stride};
    for (int64_t e : elements) {
      if (r.length > 0 && e % plan.vector_width != 0) {
        return false;
      }
    }
  }
  return true;
}

/** Kernel arguments of a ragged plan: the dense ones, flagged ragged, with no K/V strides. */
inline BatchedDecodeParams make_ragged_params(const LaunchShape& s, const LaunchPlan& plan,
                                              const InputStrides& strides, float scale, float softcap) {
  BatchedDecodeParams p = make_params(s, plan, without_kv_strides(strides), scale, softcap);
  p.ragged = 1;
  return p;
}

} // namespace mlx_batched_decode
