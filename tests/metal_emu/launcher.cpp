// C entry points of the harness library: the shared launch plan, run-time
// library names and sources, and backend choice, and emulated decode
// attention calls that bind and dispatch exactly as the Metal launcher
// (csrc/metal/decode_launch.cpp) does.
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <exception>
#include <limits>
#include <string>
#include <vector>

#include "emu_runtime.h"
#include "metal/backend_choice.h"
#include "metal/kernel_library.h"
#include "metal/launch_plan.h"
#include "metal/quantized_launch_plan.h"
#include "metal/ragged_launch_plan.h"

#if defined(__SANITIZE_ADDRESS__)
#include <sanitizer/asan_interface.h>
#endif

using namespace mlx_batched_decode;

namespace {

// Every buffer index a kernel binds: 0 .. the ragged kernel's last slot, then query_starts.
constexpr int kBindings = kQueryStarts + 1;
static_assert(kRaggedSlot0 + kRaggedSlots <= kQueryStarts && kBindings <= emu::kMaxBuffers);

int report(const std::string& message, char* error, int error_len) {
  if (error_len > 0) {
    std::strncpy(error, message.c_str(), std::size_t(error_len) - 1);
    error[error_len - 1] = '\0';
  }
  return 1;
}

// shape = {B, H_q, H_kv, L (packed: N), T, D, window (effective), dtype (0 f16, 1 bf16, 2 f32),
// main pipeline's thread limit, reduce pipeline's, has kv_starts, has sinks, Dv, has query_starts}.
constexpr int kShapeInts = 14;

LaunchShape to_shape(const int s[kShapeInts]) {
  return LaunchShape{s[0], s[1], s[2], s[3], s[4], s[5], s[6], KernelDtype(s[7]), s[10] != 0, s[11] != 0,
                     false, s[12], s[13] != 0};
}

ThreadLimits to_limits(const int s[kShapeInts]) {
  return ThreadLimits{s[8], s[9]};
}

void copy3(const Size3& s, unsigned out[3]) {
  out[0] = unsigned(s.x);
  out[1] = unsigned(s.y);
  out[2] = unsigned(s.z);
}

// The buffers bound at the kernels' indices, each counted once: an absent
// option or an unused partial is bound to another buffer's memory.
std::vector<emu::WatchedBuffer> distinct_buffers(void* const* buffers, const unsigned long long* bytes, int count) {
  std::vector<emu::WatchedBuffer> out;
  for (int i = 0; i < count; ++i) {
    const char* begin = static_cast<const char*>(buffers[i]);
    bool seen = begin == nullptr;
    for (const emu::WatchedBuffer& w : out) {
      seen |= w.begin == begin;
    }
    if (!seen) {
      out.push_back({begin, begin + bytes[i], i});
    }
  }
  return out;
}

// Binds the inputs, the output and the params at their indices as eval_gpu does.
// The B keys and B values of a ragged call as eval_gpu describes them: array i
// (keys, then values) starts at arrays[i] inside buffers[i], with strides
// strides[2i] (head) and strides[2i + 1] (position) in elements.
void ragged_arrays(int B, void* const* arrays, void* const* buffers, const long long* strides,
                   std::vector<RaggedArray>& keys, std::vector<RaggedArray>& values) {
  for (int i = 0; i < 2 * B; ++i) {
    const int64_t offset = static_cast<const char*>(arrays[i]) - static_cast<const char*>(buffers[i]);
    (i < B ? keys : values).push_back({buffers[i], offset, strides[2 * i], strides[2 * i + 1]});
  }
}

// As eval_gpu: query_starts at kQueryStarts, or valid_lens (unread) without them.
void bind_query_starts(void** buffers, unsigned long long* bytes, const int* query_starts,
                       unsigned long long query_starts_bytes) {
  buffers[kQueryStarts] = query_starts ? const_cast<int*>(query_starts) : buffers[kValidLens];
  bytes[kQueryStarts] = query_starts ? query_starts_bytes : bytes[kValidLens];
}

void bind_inputs(const LaunchShape& s, void** buffers, const void* queries, const void* keys, const void* values,
                 const int* valid_lens, const int* kv_starts, const float* sinks, void* out, void* params) {
  buffers[kQueries] = const_cast<void*>(queries);
  buffers[kKeys] = const_cast<void*>(keys);
  buffers[kValues] = const_cast<void*>(values);
  buffers[kValidLens] = const_cast<int*>(valid_lens);
  // As eval_gpu: an absent option is bound to valid_lens, and the params say it is absent.
  buffers[kKvStarts] = s.has_kv_starts ? const_cast<int*>(kv_starts) : const_cast<int*>(valid_lens);
  buffers[kSinks] = s.has_sinks ? static_cast<void*>(const_cast<float*>(sinks)) : const_cast<int*>(valid_lens);
  buffers[kOut] = out;
  buffers[kParams] = params;
}

} // namespace

extern "C" {

/** LaunchPlan as plain data for ctypes. */
struct MbdPlan {
  char kernel[96];
  char reduce_kernel[96];
  unsigned long long grid[3], group[3], reduce_grid[3], reduce_group[3];
  int num_splits, split_len, keys_span, rows_per_group, row_chunks, group_chunks, row_groups, vector_width;
  unsigned long long partial_acc_elems, partial_stats_elems;
  int tiled;
};

/** What the last emulated call did: the vector-load decision, the main pass's
 * dispatches (ragged groups; 1 otherwise) and, in a "loads" build, the bytes
 * each pass (main, reduce) loaded per buffer index. */
struct MbdLaunch {
  int vector_loads;
  int dispatches;
  unsigned long long loaded[2][emu::kMaxBuffers];
};

static MbdLaunch last_launch;

/** shape: see to_shape. */
int mbd_emu_plan(const int shape[kShapeInts], MbdPlan* out, char* error, int error_len) {
  try {
    const LaunchPlan p = make_launch_plan(to_shape(shape), to_limits(shape));
    std::memset(out, 0, sizeof(*out));
    std::strncpy(out->kernel, p.kernel.c_str(), sizeof(out->kernel) - 1);
    std::strncpy(out->reduce_kernel, p.reduce_kernel.c_str(), sizeof(out->reduce_kernel) - 1);
    const Size3* sizes[] = {&p.grid, &p.group, &p.reduce_grid, &p.reduce_group};
    unsigned long long* dest[] = {out->grid, out->group, out->reduce_grid, out->reduce_group};
    for (int i = 0; i < 4; ++i) {
      dest[i][0] = sizes[i]->x;
      dest[i][1] = sizes[i]->y;
      dest[i][2] = sizes[i]->z;
    }
    out->num_splits = p.num_splits;
    out->split_len = p.split_len;
    out->keys_span = p.keys_span;
    out->rows_per_group = p.rows_per_group;
    out->row_chunks = p.row_chunks;
    out->group_chunks = p.group_chunks;
    out->row_groups = p.row_groups;
    out->vector_width = p.vector_width;
    out->partial_acc_elems = p.partial_acc_elems;
    out->partial_stats_elems = p.partial_stats_elems;
    out->tiled = p.tiled;
    return 0;
  } catch (const std::exception& e) {
    return report(e.what(), error, error_len);
  }
}

/** The ragged layout's buffers as eval_gpu binds them: array i (keys, then
 * values) lies in buffer buffers[i] of buffer_bytes[i] bytes. */
struct RaggedBinding {
  const RaggedLayout& layout;
  void* const* buffers;
  const unsigned long long* buffer_bytes;
};

/**
 * Binds what eval_gpu binds past the inputs (the split-K partials, NaN-filled
 * so that a split that wrote nothing shows up in the result; buffers[kOut]
 * is set by the caller) and dispatches the main pass (once per group of a
 * ragged layout, binding its slots) and, when split, the reduce, which gets
 * the ragged table (buffers[kRequests], set by the caller) or valid_lens at
 * kRequests. buffers[0 .. kBindings) are bound at their indices; bytes: those
 * of every input buffer (by index; the outputs' are set here), for the load counts.
 */
static std::string run_passes(const LaunchShape& s, const LaunchPlan& plan, void** buffers,
                              unsigned long long* bytes, bool vectors, int backend,
                              const RaggedBinding* ragged = nullptr) {
  last_launch.vector_loads = vectors;
  const float nan = std::numeric_limits<float>::quiet_NaN();
  std::vector<float> partial_acc(plan.partial_acc_elems, nan);
  std::vector<float> partial_max(plan.partial_stats_elems, nan);
  std::vector<float> partial_sum(plan.partial_stats_elems, nan);
  // Single pass never touches the partials; Metal still wants every argument bound.
  const bool split = plan.num_splits > 1;
  void* out = buffers[kOut];
  buffers[kPartialAcc] = split ? static_cast<void*>(partial_acc.data()) : out;
  buffers[kPartialMax] = split ? static_cast<void*>(partial_max.data()) : out;
  buffers[kPartialSum] = split ? static_cast<void*>(partial_sum.data()) : out;
  // [B, H_q, L, Dv], or packed [N, H_q, Dv].
  const uint64_t out_rows = uint64_t(s.has_query_starts ? 1 : s.batch) * s.num_q_heads * s.num_rows;
  const uint64_t out_bytes = out_rows * value_head_dim(s) * dtype_size(s.dtype);
  bytes[kOut] = out_bytes;
  bytes[kPartialAcc] = split ? partial_acc.size() * sizeof(float) : out_bytes;
  bytes[kPartialMax] = split ? partial_max.size() * sizeof(float) : out_bytes;
  bytes[kPartialSum] = split ? partial_sum.size() * sizeof(float) : out_bytes;

  unsigned grid[3], group[3];
  copy3(plan.group, group);
  const emu::ConstantValue constants[] = {{MBD_FC_ROWS, &plan.rows_per_group, sizeof(int)},
                                          {MBD_FC_VECTOR_LOADS, &vectors, sizeof(bool)},
                                          {MBD_FC_TILED, &plan.tiled, sizeof(bool)}};
  std::string problem;
  RaggedGroupParams group_params{};
  const int dispatches = ragged ? int(ragged->layout.groups.size()) : 1;
  for (int g = 0; g < dispatches && problem.empty(); ++g) {
    copy3(plan.grid, grid);
    if (ragged) {
      // As bind_group in decode_launch.cpp: each slot at its buffer's start, unused ones to valid_lens.
      const RaggedGroup& rg = ragged->layout.groups[g];
      for (int slot = 0; slot < kRaggedSlots; ++slot) {
        const bool used = slot < int(rg.slots.size());
        buffers[kRaggedSlot0 + slot] = used ? ragged->buffers[rg.slots[slot]] : buffers[kValidLens];
        bytes[kRaggedSlot0 + slot] = used ? ragged->buffer_bytes[rg.slots[slot]] : bytes[kValidLens];
      }
      group_params.first_request = rg.first;
      group_params.num_requests = rg.count;
      buffers[kRaggedGroup] = &group_params;
      bytes[kRaggedGroup] = sizeof(group_params);
      copy3(ragged_group_grid(plan, rg), grid);
    }
    const std::vector<emu::WatchedBuffer> watched = distinct_buffers(buffers, bytes, kBindings);
    emu::watch_buffers(watched.data(), int(watched.size()));
    problem = emu::dispatch(plan.kernel.c_str(), buffers, kBindings, grid, group, emu::Backend(backend), constants, 3);
    unsigned long long loaded[emu::kMaxBuffers];
    emu::loaded_bytes(loaded);
    for (int i = 0; i < emu::kMaxBuffers; ++i) {
      last_launch.loaded[0][i] += loaded[i];
    }
    ++last_launch.dispatches;
  }
  if (problem.empty() && split) {
    if (!ragged) {
      buffers[kRequests] = buffers[kValidLens];
      bytes[kRequests] = bytes[kValidLens];
    }
    copy3(plan.reduce_grid, grid);
    copy3(plan.reduce_group, group);
    const std::vector<emu::WatchedBuffer> watched = distinct_buffers(buffers, bytes, kBindings);
    emu::watch_buffers(watched.data(), int(watched.size()));
    problem = emu::dispatch(plan.reduce_kernel.c_str(), buffers, kBindings, grid, group, emu::Backend(backend));
    emu::loaded_bytes(last_launch.loaded[1]);
  }
  return problem;
}

/**
 * Emulated batched decode attention. strides = {q batch, q head, q row, k batch,
 * k head, k seq, v batch, v head, v seq, lens, starts, sinks} in elements (values
 * of the shape's Dv columns, out [B, H_q, L, Dv] or, packed, [N, H_q, Dv]);
 * softcap: DecodeAttributes::softcap (0: scores are not capped);
 * kv_starts and sinks may be null when the shape says they are absent;
 * input_bytes: the bytes of queries, keys, values, valid_lens, kv_starts and
 * sinks from their first element (for the load counts); out is a contiguous
 * [B, H_q, L, D] buffer of the queries' dtype. backend: 0 fibers, 1 threads.
 * paged: null for the dense layout, else {block_size, num_blocks, table batch
 * stride, table page stride} of a paged call (PagedLayout), whose keys and
 * values are pools (strides {page, head, row}) and whose kv_starts is
 * block_tables int32 [B, MB], as eval_gpu of PagedDecodeAttention binds them.
 * ring_offsets: null, or the dense layout's ring offsets int32 [B] (raw: the
 * kernel takes them modulo T) of stride ring_stride and ring_bytes bytes,
 * bound at kRingOffsets as eval_gpu of BatchedDecodeAttention binds them.
 * query_starts: null, or packed queries' int32 [B + 1] (raw: the kernel checks them) of stride
 * query_starts_stride and query_starts_bytes bytes, when the shape says so; queries are then
 * the view [B, H_q, N, D] of batch stride 0. The same three close every entry point below.
 */
int mbd_emu_attention(const int shape[kShapeInts], const long long strides[12], const void* queries,
                      const void* keys, const void* values, const int* valid_lens, const int* kv_starts,
                      const float* sinks, const unsigned long long input_bytes[6], void* out, float scale,
                      float softcap, int backend, char* error, int error_len, const long long* paged,
                      const int* ring_offsets, long long ring_stride, unsigned long long ring_bytes,
                      const int* query_starts, long long query_starts_stride,
                      unsigned long long query_starts_bytes) {
  try {
    std::memset(&last_launch, 0, sizeof(last_launch));
    LaunchShape s = to_shape(shape);
    if (s.batch == 0) {  // as eval_gpu: nothing to launch
      return 0;
    }
    s.has_ring_offset = ring_offsets != nullptr;
    const LaunchPlan plan = make_launch_plan(s, to_limits(shape));
    const InputStrides st{strides[0], strides[1], strides[2],  strides[3],  strides[4],  strides[5], strides[6],
                          strides[7], strides[8], strides[9], strides[10], strides[11], ring_stride,
                          query_starts_stride};
    PagedLayout layout;
    if (paged != nullptr) {
      layout = PagedLayout{int(paged[0]), int(paged[1]), paged[2], paged[3]};
    }
    BatchedDecodeParams params = make_params(s, plan, st, scale, softcap, layout);
    // Addresses are offsets from address 0, as aligned as the start of a Metal buffer.
    const InputOffsets offsets{int64_t(reinterpret_cast<std::uintptr_t>(queries)),
                               int64_t(reinterpret_cast<std::uintptr_t>(keys)),
                               int64_t(reinterpret_cast<std::uintptr_t>(values))};
    void* buffers[kBindings] = {};
    bind_inputs(s, buffers, queries, keys, values, valid_lens, kv_starts, sinks, out, &params);
    if (paged != nullptr) {
      buffers[kKvStarts] = const_cast<int*>(kv_starts); // the block tables, as eval_gpu binds them
    }
    unsigned long long bytes[kBindings] = {input_bytes[0], input_bytes[1], input_bytes[2],
                                           input_bytes[3], input_bytes[4], input_bytes[5]};
    bytes[kParams] = sizeof(params);
    // As eval_gpu: without a ring, the dense kernel's ring slot holds valid_lens, unread.
    buffers[kRingOffsets] = ring_offsets ? const_cast<int*>(ring_offsets) : buffers[kValidLens];
    bytes[kRingOffsets] = ring_offsets ? ring_bytes : bytes[kValidLens];
    bind_query_starts(buffers, bytes, query_starts, query_starts_bytes);
    const std::string problem =
        run_passes(s, plan, buffers, bytes, vector_loads(s, plan, st, offsets, layout), backend);
    return problem.empty() ? 0 : report(problem, error, error_len);
  } catch (const std::exception& e) {
    return report(e.what(), error, error_len);
  }
}

/**
 * Emulated quantized decode attention, as mbd_emu_attention with keys and
 * values the packed uint32 words (strides in words) and, bound at
 * MBD_QUANT_KEY_SCALES .. MBD_QUANT_VALUE_BIASES, the scales and biases
 * ({key scales, key biases, value scales, value biases}); quantized_strides:
 * theirs in that order, 4 each (batch, head, position, group); quant = {bits,
 * group_size, scales dtype (0 f16, 1 bf16, 2 f32)}; input_bytes: the 6 inputs
 * of mbd_emu_attention, then the 4 scale and bias arrays.
 */
int mbd_emu_quantized_attention(const int shape[kShapeInts], const long long strides[12],
                                const long long quantized_strides[16], const int quant[3], const void* queries,
                                const void* keys, const void* values, const int* valid_lens, const int* kv_starts,
                                const float* sinks, void* const scales_biases[4],
                                const unsigned long long input_bytes[10], void* out, float scale, float softcap,
                                int backend, char* error, int error_len, const int* query_starts,
                                long long query_starts_stride, unsigned long long query_starts_bytes) {
  try {
    std::memset(&last_launch, 0, sizeof(last_launch));
    const LaunchShape s = to_shape(shape);
    if (s.batch == 0) {
      return 0;
    }
    const LaunchPlan plan = make_quantized_launch_plan(s, to_limits(shape), quant[0], quant[1]);
    const InputStrides st{strides[0], strides[1], strides[2],  strides[3],  strides[4],  strides[5], strides[6],
                          strides[7], strides[8], strides[9], strides[10], strides[11], 0, query_starts_stride};
    BatchedDecodeParams params = make_params(s, plan, st, scale, softcap);
    QuantizedStrides qs{};
    for (int side = 0; side < 2; ++side) {
      for (int axis = 0; axis < 4; ++axis) {
        qs.scales[side][axis] = quantized_strides[8 * side + axis];
        qs.biases[side][axis] = quantized_strides[8 * side + 4 + axis];
      }
    }
    QuantizedDecodeParams qparams = make_quantized_params(s, qs, quant[1], KernelDtype(quant[2]));
    void* buffers[kBindings] = {};
    bind_inputs(s, buffers, queries, keys, values, valid_lens, kv_starts, sinks, out, &params);
    unsigned long long bytes[kBindings] = {input_bytes[0], input_bytes[1], input_bytes[2],
                                           input_bytes[3], input_bytes[4], input_bytes[5]};
    bytes[kParams] = sizeof(params);
    for (int i = 0; i < 4; ++i) {
      buffers[MBD_QUANT_KEY_SCALES + i] = scales_biases[i];
      bytes[MBD_QUANT_KEY_SCALES + i] = input_bytes[6 + i];
    }
    buffers[MBD_QUANT_PARAMS] = &qparams;
    bytes[MBD_QUANT_PARAMS] = sizeof(qparams);
    bind_query_starts(buffers, bytes, query_starts, query_starts_bytes);
    const bool vectors = quantized_vector_loads(s, plan, st, int64_t(reinterpret_cast<std::uintptr_t>(queries)));
    const std::string problem = run_passes(s, plan, buffers, bytes, vectors, backend);
    return problem.empty() ? 0 : report(problem, error, error_len);
  } catch (const std::exception& e) {
    return report(e.what(), error, error_len);
  }
}

/**
 * Emulated ragged decode attention, bound and dispatched as eval_gpu of
 * RaggedDecodeAttention does: the shape's T is the longest T_b; strides as
 * mbd_emu_attention's (the K/V ones are not read); arrays, buffers, strides:
 * the B keys and B values (see ragged_arrays; arrays of one buffer name the
 * same buffers[i], and share a slot), buffer_bytes[i] the bytes of buffers[i];
 * lengths: each request's T_b; input_bytes: those of queries, valid_lens,
 * kv_starts and sinks from their first element.
 */
int mbd_emu_ragged_attention(const int shape[kShapeInts], const long long strides[12], const void* queries,
                             const int* valid_lens, const int* kv_starts, const float* sinks,
                             const unsigned long long input_bytes[4], void* const* arrays, void* const* buffers,
                             const unsigned long long* buffer_bytes, const long long* array_strides,
                             const int* lengths, void* out, float scale, float softcap, int backend, char* error,
                             int error_len, const int* query_starts, long long query_starts_stride,
                             unsigned long long query_starts_bytes) {
  try {
    std::memset(&last_launch, 0, sizeof(last_launch));
    const LaunchShape s = to_shape(shape);
    std::vector<RaggedArray> keys, values;
    ragged_arrays(s.batch, arrays, buffers, array_strides, keys, values);
    const RaggedLayout layout = make_ragged_layout(keys, values, std::vector<int>(lengths, lengths + s.batch),
                                                   s.num_kv_heads, dtype_size(s.dtype));
    const LaunchPlan plan = make_ragged_launch_plan(s, to_limits(shape));
    const InputStrides st{strides[0], strides[1], strides[2],  strides[3],  strides[4],  strides[5], strides[6],
                          strides[7], strides[8], strides[9], strides[10], strides[11], 0, query_starts_stride};
    BatchedDecodeParams params = make_ragged_params(s, plan, st, scale, softcap);
    void* buffers_bound[kBindings] = {};
    bind_inputs(s, buffers_bound, queries, nullptr, nullptr, valid_lens, kv_starts, sinks, out, &params);
    buffers_bound[kRequests] = const_cast<RaggedRequest*>(layout.table.data());
    unsigned long long bytes[kBindings] = {input_bytes[0], 0, 0, input_bytes[1], input_bytes[2], input_bytes[3]};
    bytes[kParams] = sizeof(params);
    bytes[kRequests] = layout.table.size() * sizeof(RaggedRequest);
    bind_query_starts(buffers_bound, bytes, query_starts, query_starts_bytes);
    const bool vectors =
        ragged_vector_loads(s, plan, st, int64_t(reinterpret_cast<std::uintptr_t>(queries)), layout);
    const RaggedBinding binding{layout, buffers, buffer_bytes};
    const std::string problem = run_passes(s, plan, buffers_bound, bytes, vectors, backend, &binding);
    return problem.empty() ? 0 : report(problem, error, error_len);
  } catch (const std::exception& e) {
    return report(e.what(), error, error_len);
  }
}

/**
 * make_ragged_layout of csrc/metal/ragged_launch_plan.h for B requests (arrays
 * as mbd_emu_ragged_attention's), groups of at most `slots` buffers: writes
 * the table (B entries) and, per group, {first, count, its slots' arrays, -1
 * past them} (2 + MBD_RAGGED_SLOTS ints, at most B groups); returns the
 * number of groups, or -1 with the error.
 */
int mbd_emu_ragged_layout(int B, void* const* arrays, void* const* buffers, const long long* array_strides,
                          const int* lengths, int num_kv_heads, int itemsize, int slots, RaggedRequest* table,
                          int* groups, char* error, int error_len) {
  try {
    std::vector<RaggedArray> keys, values;
    ragged_arrays(B, arrays, buffers, array_strides, keys, values);
    const RaggedLayout layout =
        make_ragged_layout(keys, values, std::vector<int>(lengths, lengths + B), num_kv_heads, itemsize, slots);
    std::copy(layout.table.begin(), layout.table.end(), table);
    for (const RaggedGroup& g : layout.groups) {
      groups[0] = g.first;
      groups[1] = g.count;
      for (int i = 0; i < kRaggedSlots; ++i) {
        groups[2 + i] = i < int(g.slots.size()) ? g.slots[i] : -1;
      }
      groups += 2 + kRaggedSlots;
    }
    return int(layout.groups.size());
  } catch (const std::exception& e) {
    report(e.what(), error, error_len);
    return -1;
  }
}

/** What the last emulated call did. */
void mbd_emu_last_launch(MbdLaunch* out) {
  *out = last_launch;
}

/** library_name (ragged: ragged_library_name; bits 4 or 8: quantized_library_name) of
 * csrc/metal/kernel_library.h; value_dim 0: Dv = D. */
void mbd_emu_library_name(const char* source_hash, int dtype, int head_dim, int value_dim, int ragged, int bits,
                          char out[128]) {
  const KernelDtype kd = KernelDtype(dtype);
  const std::string name = ragged ? ragged_library_name(source_hash, kd, head_dim, value_dim)
      : bits                      ? quantized_library_name(source_hash, kd, head_dim, value_dim, bits)
                                  : library_name(source_hash, kd, head_dim, value_dim);
  std::strncpy(out, name.c_str(), 127);
  out[127] = '\0';
}

/** library_source (ragged: ragged_library_source; bits: quantized_library_source) of
 * csrc/metal/kernel_library.h, written to out when it fits (out_len bytes, the NUL included);
 * returns its length. */
long long mbd_emu_library_source(const char* source, int dtype, int head_dim, int value_dim, int ragged, int bits,
                                 char* out, long long out_len) {
  const KernelDtype kd = KernelDtype(dtype);
  const std::string text = ragged ? ragged_library_source(source, kd, head_dim, value_dim)
      : bits                      ? quantized_library_source(source, kd, head_dim, value_dim, bits)
                                  : library_source(source, kd, head_dim, value_dim);
  if (out_len > (long long)text.size()) {
    std::memcpy(out, text.c_str(), text.size() + 1);
  }
  return (long long)text.size();
}

/** choose_metal_backend of csrc/metal/backend_choice.h, by name (null for none). */
const char* mbd_emu_metal_backend(int metal_present, int metallib_on_disk) {
  return metal_backend_name(choose_metal_backend(metal_present != 0, metallib_on_disk != 0));
}

/**
 * Makes [address, address + bytes) unreadable (poison != 0) or readable again
 * for AddressSanitizer, which then reports any read there; returns 1 in a build
 * without AddressSanitizer.
 */
int mbd_emu_poison([[maybe_unused]] void* address, [[maybe_unused]] unsigned long long bytes,
                   [[maybe_unused]] int poison) {
#if defined(__SANITIZE_ADDRESS__)
  if (poison) {
    __asan_poison_memory_region(address, bytes);
  } else {
    __asan_unpoison_memory_region(address, bytes);
  }
  return 0;
#else
  return 1;
#endif
}

/** Any registered kernel, with raw buffers bound at indices 0..count-1 and
 * function constants values[i] at indices[i]: an int, or a bool where is_bool[i]. */
int mbd_emu_dispatch(const char* kernel, void* const* buffers, int count, const unsigned grid[3],
                     const unsigned group[3], int backend, const int* constant_indices,
                     const int* constant_values, const int* is_bool, int constant_count, char* error,
                     int error_len) {
  std::vector<emu::ConstantValue> constants;
  std::vector<char> bools(constant_count);
  for (int i = 0; i < constant_count; ++i) {
    bools[i] = constant_values[i] != 0;
    constants.push_back(is_bool[i] ? emu::ConstantValue{constant_indices[i], &bools[i], sizeof(bool)}
                                   : emu::ConstantValue{constant_indices[i], &constant_values[i], sizeof(int)});
  }
  const std::string problem = emu::dispatch(kernel, buffers, count, grid, group, emu::Backend(backend),
                                            constants.data(), constant_count);
  return problem.empty() ? 0 : report(problem, error, error_len);
}

} // extern "C"
