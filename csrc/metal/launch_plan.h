// Launch plan of the batched decode attention Metal kernels. Plain C++17 so
// that the Metal launcher and the Linux emulation harness dispatch the kernels
// in exactly the same way. Shapes only: lengths and starts stay on the device.
//
// Dimensions: B requests, H_q query heads, H_kv KV heads, G = H_q / H_kv,
// L query rows per request, R = G * L rows per (request, KV head),
// T cache positions, D head dim of queries and keys, Dv of values and the output.
// Packed queries: N rows in all, request b's q_b of them (query_starts, device data).
#pragma once

#include <algorithm>
#include <cstdint>
#include <limits>
#include <stdexcept>
#include <string>

#include "../head_dims.h"
#include "../kernels/batched_decode_attention_params.h"

namespace mlx_batched_decode {

enum class KernelDtype { float16, bfloat16, float32 };

/** Shapes and static options a launch depends on, as in the op's contract. */
struct LaunchShape {
  int batch;                 // B
  int num_q_heads;           // H_q
  int num_kv_heads;          // H_kv
  int num_rows;              // L; packed queries: N
  int seq_len;               // T (capacity of the K/V views, not a length)
  int head_dim;              // D
  int window;                // effective_window(window, T): in [1, max(T, 1)]
  KernelDtype dtype;
  bool has_kv_starts;
  bool has_sinks;
  bool has_ring_offset = false; // the dense layout's ring (MBD_RING_OFFSETS)
  int value_dim = 0;            // Dv; 0: D
  bool has_query_starts = false; // packed queries (MBD_QUERY_STARTS)
};

/** Dv of head dims (D, value_dim): value_dim, or D where it is 0. */
inline int value_head_dim(int head_dim, int value_dim) {
  return value_dim > 0 ? value_dim : head_dim;
}

/** Dv of a shape. */
inline int value_head_dim(const LaunchShape& s) {
  return value_head_dim(s.head_dim, s.value_dim);
}

struct Size3 {
  uint64_t x, y, z;
};

/**
 * What the device lets each pipeline run: its MTL::ComputePipelineState's
 * maxTotalThreadsPerThreadgroup, which depends on the pipeline's registers
 * (MLX's D = 512 kernel asked 1024 threads where M1 allows it 832).
 */
struct ThreadLimits {
  int main;   // the main pass's pipeline
  int reduce; // the split-K reduce's; not read when the plan has one pass
};

/** Buffer indices; equal to the kernels' [[buffer(i)]]. */
enum BufferIndex : int {
  kQueries = 0,
  kKeys = 1,
  kValues = 2,
  kValidLens = 3,
  kKvStarts = 4,
  kSinks = 5,
  kOut = 6,
  kPartialAcc = 7,
  kPartialMax = 8,
  kPartialSum = 9,
  kParams = 10,
  kRingOffsets = MBD_RING_OFFSETS, // the dense kernel's only
  kQueryStarts = MBD_QUERY_STARTS,
};

struct LaunchPlan {
  std::string kernel;        // main pass, one threadgroup per (split, KV head x row group, request)
  std::string reduce_kernel; // split-K merge; empty when num_splits == 1
  Size3 grid;                // threadgroups of the main pass (packed: (splits, H_kv x row_groups, 1))
  Size3 group;               // threads per threadgroup of the main pass
  Size3 reduce_grid;         // threadgroups of the reduction: (L, H_q, B); packed: (N, H_q, 1)
  Size3 reduce_group;
  int num_splits;
  int split_len;
  int keys_span;             // most keys one threadgroup reads: min(T, window + L - 1)
  int rows_per_group;        // rows of a row chunk (one simdgroup's): function constant MBD_FC_ROWS
  int row_chunks;            // ceil(R / rows_per_group), all of a (request, KV head)
  int group_chunks;          // row chunks one threadgroup holds, each on group / 32 / group_chunks simdgroups
  // ceil(row_chunks / group_chunks): threadgroups per (request, KV head); packed,
  // row blocks per KV head, G * N / rows_per_block + B (the kernel's bda_block_request)
  int row_groups;
  int vector_width;          // elements per vector load (1: scalar loads), see vector_loads()
  uint64_t partial_acc_elems;   // float32 [output rows, splits, Dv]; 0 when single pass
  uint64_t partial_stats_elems; // float32 [output rows, splits] for max and for sum
  bool packed_queries;       // query_starts: the request of a threadgroup is its row block's
  bool tiled;                // the tiled path (function constant MBD_FC_TILED), see uses_tiles
};

// Split-K aims for this many threadgroups (a few per GPU core on Apple silicon).
constexpr int kTargetThreadgroups = 128;
// Fewer keys per split would make the reduction cost more than it saves.
constexpr int kMinKeysPerSplit = 64;
constexpr int kMaxSplits = 64;
// Floats of query rows one lane keeps in registers (as many again for the
// accumulators): bounds the rows per threadgroup of the widest head dims.
constexpr int kLaneQueryFloats = 64;
// The buckets of the generic kernels, by the wider of D and Dv (head_dims.h
// has the fast ones); the last one is the keys' largest head dim.
constexpr int kGenericHeadDims[] = {32, 64, 128, 256, 512, 576};
static_assert(std::end(kGenericHeadDims)[-1] == kMaxKeyHeadDim);
// Fast kernels of values narrower than keys: (192, 128) and MLA's latent (576, 512).
constexpr int kFastHeadDimPairs[][2] = {{192, 128}, {576, 512}};

/** "float16", "bfloat16" or "float32". */
inline const char* dtype_name(KernelDtype dtype) {
  constexpr const char* names[] = {"float16", "bfloat16", "float32"};
  return names[static_cast<int>(dtype)];
}

/** Whether (D, Dv) (value_dim 0: Dv = D) has a fast kernel: a fast head dim of both, or a fast pair. */
inline bool is_fast_kernel(int head_dim, int value_dim = 0) {
  const int dv = value_head_dim(head_dim, value_dim);
  if (dv == head_dim) {
    return is_fast_head_dim(head_dim);
  }
  return std::any_of(std::begin(kFastHeadDimPairs), std::end(kFastHeadDimPairs),
                     [&](const int* pair) { return pair[0] == head_dim && pair[1] == dv; });
}

/** The width a kernel is compiled for: D itself (max(D, Dv) of a fast pair), or the generic
 * bucket holding max(D, Dv). */
inline int kernel_head_dim(int head_dim, int value_dim = 0) {
  const int widest = std::max(head_dim, value_dim);
  if (is_fast_kernel(head_dim, value_dim)) {
    return widest;
  }
  return *std::find_if(std::begin(kGenericHeadDims), std::end(kGenericHeadDims),
                       [&](int n) { return widest <= n; });
}

/** Elements per vector load for head dims (D, Dv), one width for both; mirrors the kernel's choice. */
inline int vector_width(int head_dim, int value_dim = 0) {
  if (!is_fast_kernel(head_dim, value_dim)) {
    return 1;
  }
  const int dv = value_head_dim(head_dim, value_dim);
  return head_dim % 128 == 0 && dv % 128 == 0 ? 4 : 2;
}

inline int ceil_div(int64_t a, int64_t b) {
  return int((a + b - 1) / b);
}

/** The end of the kernels' host names for a dtype and head dims (D, Dv; value_dim 0: Dv = D):
 * "float16_128", "float16_576_v512", "float16_upto256". */
inline std::string kernel_suffix(KernelDtype dtype, int head_dim, int value_dim = 0) {
  const bool pair = value_dim > 0 && value_dim != head_dim;
  const std::string dim = !is_fast_kernel(head_dim, value_dim)
      ? "upto" + std::to_string(kernel_head_dim(head_dim, value_dim))
      : std::to_string(head_dim) + (pair ? "_v" + std::to_string(value_dim) : "");
  return std::string(dtype_name(dtype)) + "_" + dim;
}

/**
 * runtime_error naming the limit unless a pipeline's maxTotalThreadsPerThreadgroup
 * allows one simdgroup, the least the kernels run on: a device limit, not a bad argument.
 */
inline void check_thread_limit(int limit, const std::string& kernel) {
  if (limit < MBD_SIMD_WIDTH) {
    throw std::runtime_error("[batched_decode_attention] the pipeline " + kernel + " allows " +
                             std::to_string(limit) + " threads per threadgroup (maxTotalThreadsPerThreadgroup), " +
                             "the kernels need at least " + std::to_string(MBD_SIMD_WIDTH));
  }
}

/** Host name of the main (or reduce) kernel for a dtype and head dims. */
inline std::string kernel_name(KernelDtype dtype, int head_dim, int value_dim, bool reduce) {
  return std::string(reduce ? "batched_decode_attention_reduce_" : "batched_decode_attention_") +
      kernel_suffix(dtype, head_dim, value_dim);
}

// The tiled path takes packed queries of at least this many rows per request and KV head
// on average (G * N >= kTileMinRows * B): half a tile, where matrix products beat the vector path.
constexpr int kTileMinRows = MBD_TILE_ROWS / 2;

/**
 * Whether a launch takes the tiled path, from shapes only (the kernel's
 * function constant must not depend on thread limits): packed queries of many
 * rows (kTileMinRows), D = Dv a fast head dim that is a multiple of 8 and at
 * most MBD_TILE_MAX_DIM, and a row source with tiles (`tiles`: not the quantized one).
 */
inline bool uses_tiles(const LaunchShape& s, bool tiles = true) {
  const int G = s.num_q_heads / std::max(s.num_kv_heads, 1);
  return tiles && s.has_query_starts && value_head_dim(s) == s.head_dim && is_fast_kernel(s.head_dim) &&
      s.head_dim % 8 == 0 && s.head_dim <= MBD_TILE_MAX_DIM &&
      int64_t(G) * s.num_rows >= int64_t(kTileMinRows) * s.batch;
}

/**
 * The launch of both passes, from shapes and the pipelines' thread limits. A
 * request's R rows share each K/V row read when one threadgroup holds them
 * all: one simdgroup per row chunk at least, so a limit below
 * 32 x row_chunks splits them into row groups, which read the keys again.
 *
 * Packed queries (N rows, q_b per request on the device): row groups are
 * sized for the mean request, ceil(N / B) rows, and the grid holds G * N /
 * rows_per_block + B row blocks per KV head (rows_per_block = group_chunks x
 * rows_per_group), enough for any q_b that sum to N: the kernel maps a block to
 * its request by binary search over query_starts, and blocks past a request's
 * rows return at once.
 *
 * Tiled (uses_tiles; `tiles` false for a row source without them): row blocks
 * of MBD_TILE_ROWS rows, MBD_TILE_SIMDGROUPS simdgroups of 8 rows each, one pass.
 */
inline LaunchPlan make_launch_plan(const LaunchShape& s, const ThreadLimits& limits, bool tiles = true) {
  const std::string prefix = "[batched_decode_attention] ";
  if (s.batch < 1 || s.num_q_heads < 1 || s.num_kv_heads < 1 || s.num_rows < 1 || s.seq_len < 0) {
    throw std::invalid_argument(prefix + "B, H_q, H_kv and L must be positive and T >= 0");
  }
  if (s.num_q_heads % s.num_kv_heads != 0) {
    throw std::invalid_argument(prefix + "H_q must be a multiple of H_kv");
  }
  const int dv = value_head_dim(s);
  if (s.head_dim < 1 || s.head_dim > kMaxKeyHeadDim) {
    throw std::invalid_argument(prefix + "head dim " + std::to_string(s.head_dim) + " has no Metal kernel (1 to " +
                                std::to_string(kMaxKeyHeadDim) + ")");
  }
  if (dv < 1 || dv > kMaxHeadDim) {
    throw std::invalid_argument(prefix + "the values' head dim " + std::to_string(dv) + " has no Metal kernel (1 to " +
                                std::to_string(kMaxHeadDim) + ")");
  }
  if (s.window < 1 || s.window > std::max(s.seq_len, 1)) {
    throw std::invalid_argument(
        prefix + "window " + std::to_string(s.window) + " must be in [1, max(T, 1)] (effective_window)");
  }
  LaunchPlan p{};
  p.kernel = kernel_name(s.dtype, s.head_dim, dv, false);
  check_thread_limit(limits.main, p.kernel);
  p.vector_width = vector_width(s.head_dim, dv);
  p.packed_queries = s.has_query_starts;

  // The kernel counts rows (and the grid its row chunks) in 32 bits.
  if (int64_t(s.num_q_heads) * s.num_rows > std::numeric_limits<int>::max()) {
    throw std::invalid_argument(prefix + "H_q * L = " + std::to_string(int64_t(s.num_q_heads) * s.num_rows) +
                                " query rows per request is more than the Metal kernel counts");
  }
  const int G = s.num_q_heads / s.num_kv_heads;
  // Rows of one request: L, or, packed, the mean q_b.
  const int64_t rows = int64_t(G) * (s.has_query_starts ? ceil_div(s.num_rows, s.batch) : s.num_rows);
  // Registers per lane and query row: the compiled head dim over 32 lanes, in whole loads.
  const int lane_floats =
      ceil_div(kernel_head_dim(s.head_dim, dv), int64_t(MBD_SIMD_WIDTH) * p.vector_width) * p.vector_width;
  // Chunks of equal rows (within one), as few as the registers allow.
  const int64_t most_rows = std::min<int64_t>({rows, MBD_MAX_ROWS, std::max(1, kLaneQueryFloats / lane_floats)});
  p.row_chunks = ceil_div(rows, most_rows);
  p.rows_per_group = ceil_div(rows, p.row_chunks);
  // One simdgroup per chunk at least: a smaller limit spreads the chunks over row groups.
  const int simdgroups = std::min(MBD_MAX_SIMDGROUPS, limits.main / MBD_SIMD_WIDTH);
  p.row_groups = ceil_div(p.row_chunks, simdgroups);
  p.group_chunks = ceil_div(p.row_chunks, p.row_groups);
  const int streams = simdgroups / p.group_chunks;
  // A threadgroup's rows cover at most L consecutive positions, each reading at most window keys;
  // packed, the positions its block's rows (i, then g) can span, of one request's at most N.
  const int block_rows = p.group_chunks * p.rows_per_group;
  const int64_t positions =
      s.has_query_starts ? std::min<int64_t>(s.num_rows, 1 + ceil_div(block_rows - 1, G)) : s.num_rows;
  p.keys_span = int(std::min<int64_t>(s.seq_len, int64_t(s.window) + positions - 1));
  if (s.has_query_starts) {
    p.row_groups = int(int64_t(G) * s.num_rows / block_rows + s.batch);
  }
  const int64_t requests = s.has_query_starts ? 1 : s.batch;
  p.tiled = uses_tiles(s, tiles);
  if (p.tiled) {
    p.rows_per_group = 8;
    p.group_chunks = MBD_TILE_SIMDGROUPS;
    p.row_chunks = ceil_div(rows, p.rows_per_group);
    p.row_groups = int(int64_t(G) * s.num_rows / MBD_TILE_ROWS + s.batch);
    const int64_t tile_positions = std::min<int64_t>(s.num_rows, 1 + ceil_div(MBD_TILE_ROWS - 1, G));
    p.keys_span = int(std::min<int64_t>(s.seq_len, int64_t(s.window) + tile_positions - 1));
    p.num_splits = 1;
    p.split_len = std::max(1, p.keys_span);
    p.grid = {1, uint64_t(s.num_kv_heads) * p.row_groups, 1};
    p.group = {uint64_t(MBD_TILE_SIMDGROUPS) * MBD_SIMD_WIDTH, 1, 1};
    return p;
  }

  // Split the keys only when (request, KV head, row group) items can't fill the GPU.
  const int64_t items = requests * s.num_kv_heads * p.row_groups;
  int splits = 1;
  if (items < kTargetThreadgroups) {
    splits = int(std::max<int64_t>(1, std::min<int64_t>(
        {(kTargetThreadgroups + items - 1) / items,
         int64_t(p.keys_span / kMinKeysPerSplit),
         int64_t(kMaxSplits)})));
  }
  p.split_len = std::max(1, ceil_div(p.keys_span, splits));
  // Recount so that no split starts at or past the span.
  p.num_splits = std::max(1, ceil_div(p.keys_span, p.split_len));

  p.grid = {uint64_t(p.num_splits), uint64_t(s.num_kv_heads) * p.row_groups, uint64_t(requests)};
  p.group = {uint64_t(p.group_chunks) * streams * MBD_SIMD_WIDTH, 1, 1};
  if (p.num_splits > 1) {
    p.reduce_kernel = kernel_name(s.dtype, s.head_dim, dv, true);
    check_thread_limit(limits.reduce, p.reduce_kernel);
    // One threadgroup per output row and query head: (L, H_q, B), or packed (N, H_q, 1).
    p.reduce_grid = {uint64_t(s.num_rows), uint64_t(s.num_q_heads), uint64_t(requests)};
    const int reduce_threads = std::min(
        ceil_div(dv, MBD_SIMD_WIDTH) * MBD_SIMD_WIDTH,
        limits.reduce / MBD_SIMD_WIDTH * MBD_SIMD_WIDTH);
    p.reduce_group = {uint64_t(reduce_threads), 1, 1};
    p.partial_stats_elems = uint64_t(requests) * s.num_q_heads * s.num_rows * p.num_splits;
    p.partial_acc_elems = p.partial_stats_elems * dv;
  }
  return p;
}

/**
 * Strides (in elements) of queries [B, H_q, L, D] (packed: the view [B, H_q, N, D]
 * of batch stride 0), keys [B, H_kv, T, D], values [B, H_kv, T, Dv], valid_lens [B],
 * kv_starts [B], sinks [H_q], ring offsets [B] and query_starts [B + 1] (the last four:
 * any value when absent).
 */
struct InputStrides {
  int64_t q_batch, q_head, q_row;
  int64_t k_batch, k_head, k_seq;
  int64_t v_batch, v_head, v_seq;
  int64_t lens;
  int64_t starts;
  int64_t sinks;
  int64_t ring = 0;
  int64_t query_starts = 0;
};

/**
 * The paged layout (paged_decode_attention): keys and values are pools
 * [NB, BS, H_kv, D] whose InputStrides k/v_batch step pages and k/v_seq rows
 * of a page, and block_tables int32 [B, MB] is bound in place of kv_starts.
 * T = MB * BS. block_size 0: the dense layout.
 */
struct PagedLayout {
  int block_size = 0;
  int num_blocks = 0;
  int64_t table_batch = 0, table_page = 0;
};

/** `strides` with those of size-1 axes (never stepped along) and of absent options set to 0. */
inline InputStrides effective_strides(const LaunchShape& s, const InputStrides& strides, const PagedLayout& paged = {}) {
  InputStrides st = strides;
  if (s.batch == 1) {
    st.q_batch = st.lens = st.starts = st.ring = 0;
    // Pages are not requests: a paged pool steps pages whatever B is.
    if (paged.block_size == 0) {
      st.k_batch = st.v_batch = 0;
    }
  }
  if (paged.block_size > 0 && paged.num_blocks == 1) {
    st.k_batch = st.v_batch = 0;
  }
  if (s.num_q_heads == 1) {
    st.q_head = st.sinks = 0;
  }
  if (s.num_kv_heads == 1) {
    st.k_head = st.v_head = 0;
  }
  if (s.num_rows == 1) {
    st.q_row = 0;
  }
  if (s.seq_len <= 1) {
    st.k_seq = st.v_seq = 0;
  }
  if (!s.has_kv_starts) {
    st.starts = 0;
  }
  if (!s.has_sinks) {
    st.sinks = 0;
  }
  if (!s.has_ring_offset) {
    st.ring = 0;
  }
  // Every request reads the one [N, H_q, D] array of packed rows.
  if (s.has_query_starts) {
    st.q_batch = 0;
  } else {
    st.query_starts = 0;
  }
  return st;
}

/** Byte offsets of the first elements of queries, keys and values from the start of their
 * buffers, which Metal aligns to at least 16 bytes. */
struct InputOffsets {
  int64_t q, k, v;
};

inline int dtype_size(KernelDtype dtype) {
  return dtype == KernelDtype::float32 ? 4 : 2;
}

/**
 * Whether the main kernel loads whole vectors (function constant
 * MBD_FC_VECTOR_LOADS): every Q, K and V row starts on a multiple of the
 * plan's vector width. Views with other offsets or strides (a slice starting
 * at an odd column, a row stride of D + 1) take one scalar load per element.
 */
inline bool vector_loads(const LaunchShape& s, const LaunchPlan& plan, const InputStrides& strides,
                         const InputOffsets& offsets, const PagedLayout& paged = {}) {
  const InputStrides st = effective_strides(s, strides, paged);
  const int64_t elements[] = {st.q_batch, st.q_head, st.q_row,  st.k_batch, st.k_head,
                              st.k_seq,   st.v_batch, st.v_head, st.v_seq};
  const int64_t bytes[] = {offsets.q, offsets.k, offsets.v};
  const int64_t vector_bytes = int64_t(plan.vector_width) * dtype_size(s.dtype);
  const auto multiple_of = [](int64_t n) { return [n](int64_t x) { return x % n == 0; }; };
  return std::all_of(std::begin(elements), std::end(elements), multiple_of(plan.vector_width)) &&
      std::all_of(std::begin(bytes), std::end(bytes), multiple_of(vector_bytes));
}

/** Kernel arguments for a plan; softcap 0 caps no score (DecodeAttributes::softcap). */
inline BatchedDecodeParams make_params(
    const LaunchShape& s,
    const LaunchPlan& plan,
    const InputStrides& strides,
    float scale,
    float softcap,
    const PagedLayout& paged = {}) {
  const InputStrides st = effective_strides(s, strides, paged);
  BatchedDecodeParams p{};
  p.q_batch_stride = st.q_batch;
  p.q_head_stride = st.q_head;
  p.q_row_stride = st.q_row;
  p.k_batch_stride = st.k_batch;
  p.k_head_stride = st.k_head;
  p.k_seq_stride = st.k_seq;
  p.v_batch_stride = st.v_batch;
  p.v_head_stride = st.v_head;
  p.v_seq_stride = st.v_seq;
  p.lens_stride = st.lens;
  p.starts_stride = st.starts;
  p.sinks_stride = st.sinks;
  p.num_q_heads = s.num_q_heads;
  p.gqa_factor = s.num_q_heads / s.num_kv_heads;
  p.num_rows = s.num_rows;
  p.head_dim = s.head_dim;
  p.row_groups = plan.row_groups;
  p.group_chunks = plan.group_chunks;
  p.seq_len = s.seq_len;
  p.window = s.window;
  p.num_splits = plan.num_splits;
  p.split_len = plan.split_len;
  p.has_kv_starts = s.has_kv_starts ? 1 : 0;
  p.has_sinks = s.has_sinks ? 1 : 0;
  p.scale = scale;
  p.softcap = softcap;
  p.block_size = paged.block_size;
  p.num_blocks = paged.num_blocks;
  p.table_batch_stride = paged.table_batch;
  p.table_page_stride = paged.table_page;
  p.has_ring_offset = s.has_ring_offset ? 1 : 0;
  p.ring_stride = st.ring;
  p.value_dim = value_head_dim(s);
  p.num_requests = s.batch;
  p.has_query_starts = s.has_query_starts ? 1 : 0;
  p.query_starts_stride = st.query_starts;
  return p;
}

} // namespace mlx_batched_decode
