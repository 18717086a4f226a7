// eval_cpu: describes the call in plain terms and queues the fused kernel on
// the stream's CPU command encoder.
#include <stdexcept>

#include "batched_decode_attention.h"
#include "cpu/decode_args.h"
#include "cpu/parallel_decode.h"
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

} // namespace

void BatchedDecodeAttention::eval_cpu(
    const std::vector<mx::array>& inputs,
    mx::array& out) {
  const auto& q = inputs[0];
  const auto& k = inputs[1];
  const auto& v = inputs[2];
  const auto& lens = inputs[3];
  const mx::array* starts = has_kv_starts_ ? &inputs[4] : nullptr;
  const mx::array* sinks = has_sinks_ ? &inputs[4 + has_kv_starts_] : nullptr;
  out.set_data(mx::allocator::malloc(out.nbytes()));

  cpu::DecodeArgs a{};
  a.queries = q.data<void>();
  a.keys = k.data<void>();
  a.values = v.data<void>();
  a.valid_lens = lens.data<int32_t>();
  a.kv_starts = starts ? starts->data<int32_t>() : nullptr;
  a.sinks = sinks ? sinks->data<float>() : nullptr;
  a.out = out.data<void>();
  a.dtype = to_kernel_dtype(q.dtype());
  a.B = q.shape(0);
  a.H_q = q.shape(1);
  a.H_kv = k.shape(1);
  a.G = a.H_q / a.H_kv;
  a.L = q.shape(2);
  a.T = k.shape(2);
  a.D = q.shape(3);
  a.Dp = cpu::padded_head_dim(a.D);
  a.window = effective_window(window_, a.T);
  for (int i = 0; i < 4; ++i) {
    a.q_stride[i] = q.strides(i);
    a.k_stride[i] = k.strides(i);
    a.v_stride[i] = v.strides(i);
  }
  a.lens_stride = lens.strides(0);
  a.starts_stride = starts ? starts->strides(0) : 0;
  a.sinks_stride = sinks ? sinks->strides(0) : 0;
  a.scale = scale_;

  auto& encoder = mx::cpu::get_command_encoder(stream());
  for (const mx::array& in : inputs) {
    encoder.set_input_array(in);
  }
  encoder.set_output_array(out);
  // Only the plain description is captured; the inputs outlive the task.
  encoder.dispatch([a]() { cpu::run_decode(a); });
}

} // namespace mlx_batched_decode
