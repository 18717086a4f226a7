// eval_cpu of the quantized op: describes the call in plain terms, keys and
// values as packed words plus their scales and biases, and queues the one CPU
// kernel on the stream's command encoder.
#include "cpu/decode_args.h"
#include "cpu/parallel_decode.h"
#include "batched_decode_attention.h"
#include "mlx/allocator.h"
#include "mlx/backend/cpu/encoder.h"
#include "quantized_batched_decode_attention.h"

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

void QuantizedBatchedDecodeAttention::eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) {
  const auto& q = inputs[kQuantQueries];
  const auto& k = inputs[kKeyWords];
  const auto& v = inputs[kValueWords];
  const auto& lens = inputs[kQuantValidLens];
  const mx::array* starts = has_kv_starts_ ? &inputs[kQuantOptions] : nullptr;
  const mx::array* sinks = has_sinks_ ? &inputs[kQuantOptions + has_kv_starts_] : nullptr;
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
  a.Dp = a.D; // a multiple of group_size, so of 32
  a.window = effective_window(window_, a.T);
  a.quant.bits = bits_;
  a.quant.group_size = group_size_;
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
