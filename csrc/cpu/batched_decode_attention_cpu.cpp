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
  out.set_data(mx::allocator::malloc(out.nbytes()));

  cpu::DecodeArgs a{};
  a.queries = q.data<void>();
  a.keys = k.data<void>();
  a.values = v.data<void>();
  a.valid_lens = lens.data<int32_t>();
  a.out = out.data<void>();
  a.dtype = to_kernel_dtype(q.dtype());
  a.B = q.shape(0);
  a.H_q = q.shape(1);
  a.H_kv = k.shape(1);
  a.G = a.H_q / a.H_kv;
  a.T = k.shape(2);
  a.D = q.shape(3);
  a.q_stride[0] = q.strides(0);
  a.q_stride[1] = q.strides(1);
  a.q_stride[2] = q.strides(3);
  for (int i = 0; i < 4; ++i) {
    a.k_stride[i] = k.strides(i);
    a.v_stride[i] = v.strides(i);
  }
  a.lens_stride = lens.strides(0);
  a.scale = scale_;

  auto& encoder = mx::cpu::get_command_encoder(stream());
  encoder.set_input_array(q);
  encoder.set_input_array(k);
  encoder.set_input_array(v);
  encoder.set_input_array(lens);
  encoder.set_output_array(out);
  // Only the plain description is captured; the inputs outlive the task.
  encoder.dispatch([a]() { cpu::run_decode(a); });
}

} // namespace mlx_batched_decode
