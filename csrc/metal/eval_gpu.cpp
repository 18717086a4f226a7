// eval_gpu of the op family: each op states its shapes, strides and row
// source, and the one launch tail (decode_launch.cpp) plans, binds and
// dispatches. Compiled only where MLX_BUILD_METAL is set (cmake/metal.cmake).
#include "mlx/allocator.h"

#include "../decode_primitive.h"
#include "decode_launch.h"
#include "launch_plan.h"

namespace mlx_batched_decode {

namespace {

// Launches p on its inputs: the rows of p.rows(), whose block tables, if
// any, are bound in the kv_starts slot (the paged layout); quantized adds the
// quantized rows' buffers.
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
  if (out.size() == 0) { // B == 0: nothing to launch
    out.set_data(mx::allocator::malloc(0));
    return;
  }
  check_last_axis(q, "queries");
  check_last_axis(k, "keys");
  check_last_axis(v, "values");
  const DecodeAttributes& at = p.attributes();
  const LaunchShape shape{
      q.shape(0), q.shape(1), rows.H_kv, q.shape(2), rows.T, q.shape(3), effective_window(at.window, rows.T),
      kernel_dtype(q.dtype()),
      /* max_threads_per_group, set by the launch */ MBD_SIMD_WIDTH, at.has_kv_starts, at.has_sinks};
  const int batch = rows.axes[0], head = rows.axes[1], seq = rows.axes[2];
  const InputStrides strides{q.strides(0),     q.strides(1),    q.strides(2),
                             k.strides(batch), k.strides(head), k.strides(seq),
                             v.strides(batch), v.strides(head), v.strides(seq),
                             lens.strides(0),  tables ? 0 : starts.strides(0), sinks.strides(0)};
  // Metal buffers start at least 16-byte aligned, so the views' byte offsets decide the vector loads.
  const InputOffsets offsets{q.offset(), k.offset(), v.offset()};
  const PagedLayout paged = tables ? PagedLayout{k.shape(seq), k.shape(batch), tables->strides(0), tables->strides(1)}
                                   : PagedLayout{};
  launch_decode_attention(p.stream(), p.name(), shape, strides, offsets, paged, at.scale,
                          {q, k, v, lens, starts, sinks}, out, quantized);
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

} // namespace mlx_batched_decode
