// eval_gpu of the op family: each op states its shapes, strides and row
// source, and the one launch tail (decode_launch.cpp) plans, binds and
// dispatches. Compiled only where MLX_BUILD_METAL is set (cmake/metal.cmake).
#include <array>
#include <string>
#include <vector>

#include "mlx/allocator.h"

#include "../decode_primitive.h"
#include "decode_launch.h"
#include "launch_plan.h"
#include "ragged_launch_plan.h"

namespace mlx_batched_decode {

namespace {

constexpr const char* kRaggedOp = "ragged_decode_attention";

// Request b's keys or values (`list`) of the ragged layout, as the plan groups them.
RaggedArray ragged_array(const mx::array& a, const char* list, int b) {
  if (a.size() == 0) { // no position: never read, binds nothing
    return {nullptr, 0, 0, 0};
  }
  check_last_axis(kRaggedOp, a, std::string(list) + "[" + std::to_string(b) + "]");
  const std::array<int, 3> axes = request_axes(a);
  return {a.buffer().ptr(), a.offset(), a.strides(axes[0]), a.strides(axes[1])};
}

// The table and dispatch groups of the ragged layout's B requests.
RaggedLayout ragged_layout(const RowArrays& rows, int B) {
  std::vector<RaggedArray> keys, values;
  std::vector<int> lengths;
  for (int b = 0; b < B; ++b) {
    keys.push_back(ragged_array(rows.request_keys[b], "keys", b));
    values.push_back(ragged_array(rows.request_values[b], "values", b));
    lengths.push_back(request_length(rows.request_keys[b]));
  }
  return make_ragged_layout(keys, values, lengths, rows.H_kv, int(rows.keys.itemsize()));
}

// Launches p on its inputs: the rows of p.rows(), whose block tables, if
// any, are bound in the kv_starts slot (the paged layout), or which hold one
// buffer per request (the ragged layout); quantized adds the quantized rows'
// buffers; a dense call's ring offsets are bound at kRingOffsets.
void launch(DecodePrimitive& p, const std::vector<mx::array>& inputs, mx::array& out,
            const QuantizedBuffers* quantized = nullptr) {
  const RowArrays rows = p.rows(inputs);
  const mx::array* tables = rows.block_tables;
  const mx::array& q = inputs[0];
  const mx::array& k = rows.keys;
  const mx::array& v = rows.values;
  const mx::array& lens = p.valid_lens(inputs);
  // Absent options are bound to valid_lens (every argument needs a buffer); the params say they are absent.
  const mx::array* given_starts = p.kv_starts(inputs);
  const mx::array& starts = tables ? *tables : given_starts ? *given_starts : lens;
  const mx::array& sinks = p.sinks(inputs) ? *p.sinks(inputs) : lens;
  // The dense layout's ring (int32 [B], already in [0, T)); the dense kernel's slot holds valid_lens without one.
  const mx::array* ring = p.ring_offset(inputs);
  // Packed queries: q is the view [B, H_q, N, D] of batch stride 0 and out [N, H_q, Dv].
  const mx::array* query_starts = p.query_starts(inputs);
  if (out.size() == 0) { // B == 0: nothing to launch
    out.set_data(mx::allocator::malloc(0));
    return;
  }
  const bool per_request = rows.request_keys != nullptr;
  check_last_axis(per_request ? kRaggedOp : "batched_decode_attention", q, "queries");
  if (!per_request) {
    check_last_axis("batched_decode_attention", k, "keys");
    check_last_axis("batched_decode_attention", v, "values");
  }
  const DecodeAttributes& at = p.attributes();
  const LaunchShape shape{
      q.shape(0), q.shape(1), rows.H_kv, q.shape(2), rows.T, q.shape(3), effective_window(at.window, rows.T),
      kernel_dtype(q.dtype()), at.has_kv_starts, at.has_sinks, ring != nullptr, p.value_dim(inputs),
      query_starts != nullptr};
  const int batch = rows.axes[0], head = rows.axes[1], seq = rows.axes[2];
  // The ragged layout's K/V strides and offsets are each request's, in its table: 0 here.
  const auto kv = [&](const mx::array& a, int axis) { return per_request ? 0 : a.strides(axis); };
  const InputStrides strides{q.strides(0),   q.strides(1),   q.strides(2),
                             kv(k, batch),   kv(k, head),    kv(k, seq),
                             kv(v, batch),   kv(v, head),    kv(v, seq),
                             lens.strides(0), tables ? 0 : starts.strides(0), sinks.strides(0),
                             ring ? ring->strides(0) : 0,    query_starts ? query_starts->strides(0) : 0};
  // Metal buffers start at least 16-byte aligned, so the views' byte offsets decide the vector loads.
  const InputOffsets offsets{q.offset(), per_request ? 0 : k.offset(), per_request ? 0 : v.offset()};
  const PagedLayout paged = tables ? PagedLayout{k.shape(seq), k.shape(batch), tables->strides(0), tables->strides(1)}
                                   : PagedLayout{};
  const RaggedLayout layout = per_request ? ragged_layout(rows, q.shape(0)) : RaggedLayout{};
  const RaggedBuffers ragged{layout, rows.request_keys, rows.request_values};
  launch_decode_attention(p.stream(), p.name(), shape, strides, offsets, paged, at.scale, at.softcap,
                          {q, k, v, lens, starts, sinks, ring ? *ring : lens, query_starts ? *query_starts : lens},
                          out, quantized,
                          per_request ? &ragged : nullptr);
}

} // namespace

void BatchedDecodeAttention::eval_gpu(const std::vector<mx::array>& inputs, mx::array& out) {
  launch(*this, inputs, out);
}

// A block shared by several requests is read once per request.
void PagedDecodeAttention::eval_gpu(const std::vector<mx::array>& inputs, mx::array& out) {
  launch(*this, inputs, out);
}

// The dense core with the quantized row source; the split-K reduce is the dense one.
void QuantizedBatchedDecodeAttention::eval_gpu(const std::vector<mx::array>& inputs, mx::array& out) {
  const QuantizedBuffers quantized{attributes().bits,   attributes().group_size, inputs[kKeyScales],
                                   inputs[kKeyBiases],  inputs[kValueScales],    inputs[kValueBiases]};
  launch(*this, inputs, out, &quantized);
}

// Each request's own buffers, bound in groups; the split-K reduce is the dense one.
void RaggedDecodeAttention::eval_gpu(const std::vector<mx::array>& inputs, mx::array& out) {
  launch(*this, inputs, out);
}

} // namespace mlx_batched_decode
