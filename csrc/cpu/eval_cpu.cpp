// eval_cpu of the op family: each op describes its call in plain terms
// (DecodeArgs: the part every layout shares, then what its row source adds)
// and queues the one CPU kernel on the stream's command encoder.
#include <algorithm>
#include <array>
#include <memory>
#include <vector>

#include "cpu/decode_args.h"
#include "cpu/parallel_decode.h"
#include "decode_primitive.h"
#include "mlx/allocator.h"
#include "mlx/backend/cpu/encoder.h"

namespace mlx_batched_decode {

namespace {

cpu::Dtype to_kernel_dtype(mx::Dtype t) {
  if (t == mx::float16) {
    return cpu::Dtype::float16;
  }
  if (t == mx::bfloat16) {
    return cpu::Dtype::bfloat16;
  }
  return cpu::Dtype::float32;
}

// A call's description: everything but the quantized rows' scales and
// biases; allocates out.
cpu::DecodeArgs describe(const DecodePrimitive& p, const std::vector<mx::array>& inputs, mx::array& out) {
  const RowArrays rows = p.rows(inputs);
  const mx::array& q = inputs[0];
  const mx::array& lens = p.valid_lens(inputs);
  const mx::array* starts = p.kv_starts(inputs);
  const mx::array* sinks = p.sinks(inputs);
  const mx::array* ring = p.ring_offset(inputs);
  out.set_data(mx::allocator::malloc(out.nbytes()));

  cpu::DecodeArgs a{};
  a.queries = q.data<void>();
  a.keys = rows.keys.data<void>();
  a.values = rows.values.data<void>();
  a.valid_lens = lens.data<int32_t>();
  a.kv_starts = starts ? starts->data<int32_t>() : nullptr;
  a.sinks = sinks ? sinks->data<float>() : nullptr;
  a.out = out.data<void>();
  a.dtype = to_kernel_dtype(q.dtype());
  a.B = q.shape(0);
  a.H_q = q.shape(1);
  a.H_kv = rows.H_kv;
  a.G = a.H_q / a.H_kv;
  a.L = q.shape(2);
  a.T = rows.T;
  a.D = q.shape(3);
  a.Dp = cpu::padded_head_dim(a.D);
  a.Dv = out.shape(-1);
  a.Dvp = cpu::padded_head_dim(a.Dv);
  a.window = effective_window(p.attributes().window, a.T);
  for (int i = 0; i < 4; ++i) {
    a.q_stride[i] = q.strides(i);
    // The ragged layout's strides are each request's (DecodeArgs::of_request).
    if (rows.request_keys == nullptr) {
      a.k_stride[i] = rows.keys.strides(rows.axes[i]);
      a.v_stride[i] = rows.values.strides(rows.axes[i]);
    }
  }
  a.lens_stride = lens.strides(0);
  a.starts_stride = starts ? starts->strides(0) : 0;
  a.sinks_stride = sinks ? sinks->strides(0) : 0;
  a.ring_offsets = ring ? ring->data<int32_t>() : nullptr;
  a.ring_stride = ring ? ring->strides(0) : 0;
  a.scale = p.attributes().scale;
  a.softcap = p.attributes().softcap;
  if (const mx::array* qs = p.query_starts(inputs)) {
    a.query_starts = qs->data<int32_t>();
    a.query_starts_stride = qs->strides(0);
  }
  // out: [B, H_q, L, D], or [N, H_q, D] for packed rows.
  if (a.query_starts) {
    a.out_stride[0] = 0;
    a.out_stride[1] = out.strides(1);
    a.out_stride[2] = out.strides(0);
  } else {
    std::copy_n(out.strides().begin(), 3, a.out_stride);
  }
  if (const mx::array* tables = rows.block_tables) {
    a.block_tables = tables->data<int32_t>();
    a.table_stride[0] = tables->strides(0);
    a.table_stride[1] = tables->strides(1);
    a.block_size = rows.keys.shape(rows.axes[2]);
    a.num_blocks = rows.keys.shape(rows.axes[0]);
  }
  return a;
}

// requests, if not null, is the ragged layout's table, which a.requests is
// pointed at inside the task that owns it.
void queue(const mx::Stream& stream, const std::vector<mx::array>& inputs, mx::array& out,
           const cpu::DecodeArgs& a, std::shared_ptr<std::vector<cpu::RequestRows>> requests = nullptr) {
  auto& encoder = mx::cpu::get_command_encoder(stream);
  for (const mx::array& in : inputs) {
    encoder.set_input_array(in);
  }
  encoder.set_output_array(out);
  // Only plain descriptions are captured; the inputs outlive the task.
  encoder.dispatch([a, requests = std::move(requests)]() {
    cpu::DecodeArgs args = a;
    args.requests = requests ? requests->data() : nullptr;
    cpu::run_decode(args);
  });
}

// Request b's keys or values of the ragged layout as the kernel reads them:
// strides {0, head, position, dim}.
void request_strides(const mx::array& a, int64_t* stride) {
  const std::array<int, 3> axes = request_axes(a);
  stride[0] = 0;
  for (int i = 0; i < 3; ++i) {
    stride[1 + i] = a.strides(axes[i]);
  }
}

} // namespace

void BatchedDecodeAttention::eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) {
  queue(stream(), inputs, out, describe(*this, inputs, out));
}

void PagedDecodeAttention::eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) {
  queue(stream(), inputs, out, describe(*this, inputs, out));
}

void QuantizedBatchedDecodeAttention::eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) {
  cpu::DecodeArgs a = describe(*this, inputs, out);
  // Multiples of group_size, so of 32: no padding.
  a.Dp = a.D;
  a.Dvp = a.Dv;
  a.quant.bits = attributes().bits;
  a.quant.group_size = attributes().group_size;
  a.quant.scales_dtype = to_kernel_dtype(inputs[kKeyScales].dtype());
  for (int side = 0; side < 2; ++side) {
    const mx::array& scales = inputs[side ? kValueScales : kKeyScales];
    const mx::array& biases = inputs[side ? kValueBiases : kKeyBiases];
    a.quant.scales[side] = scales.data<void>();
    a.quant.biases[side] = biases.data<void>();
    for (int i = 0; i < 4; ++i) {
      a.quant.scales_stride[side][i] = scales.strides(i);
      a.quant.biases_stride[side][i] = biases.strides(i);
    }
  }
  queue(stream(), inputs, out, a);
}

void RaggedDecodeAttention::eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) {
  const cpu::DecodeArgs a = describe(*this, inputs, out);
  const RowArrays rows = this->rows(inputs);
  auto requests = std::make_shared<std::vector<cpu::RequestRows>>(a.B);
  for (int b = 0; b < a.B; ++b) {
    const mx::array& k = rows.request_keys[b];
    const mx::array& v = rows.request_values[b];
    cpu::RequestRows& r = (*requests)[b];
    r.keys = k.data<void>();
    r.values = v.data<void>();
    request_strides(k, r.k_stride);
    request_strides(v, r.v_stride);
    r.length = request_length(k);
  }
  queue(stream(), inputs, out, a, std::move(requests));
}

} // namespace mlx_batched_decode
