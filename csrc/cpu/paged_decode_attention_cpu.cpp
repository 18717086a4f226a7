// eval_cpu of the paged op: the dense kernel's plain description, with the
// pools as the row source (cpu/row_source.h), queued on the stream's CPU
// command encoder.
#include "batched_decode_attention.h"
#include "cpu/decode_args.h"
#include "cpu/parallel_decode.h"
#include "mlx/allocator.h"
#include "mlx/backend/cpu/encoder.h"
#include "paged_decode_attention.h"

namespace mlx_batched_decode {

void PagedDecodeAttention::eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) {
  const auto& q = inputs[0];
  const auto& k = inputs[1];
  const auto& v = inputs[2];
  const auto& tables = inputs[3];
  const auto& lens = inputs[4];
  const mx::array* sinks = has_sinks_ ? &inputs[5] : nullptr;
  out.set_data(mx::allocator::malloc(out.nbytes()));

  cpu::DecodeArgs a{};
  a.queries = q.data<void>();
  a.keys = k.data<void>();
  a.values = v.data<void>();
  a.block_tables = tables.data<int32_t>();
  a.table_stride[0] = tables.strides(0);
  a.table_stride[1] = tables.strides(1);
  a.block_size = k.shape(1);
  a.num_blocks = k.shape(0);
  a.valid_lens = lens.data<int32_t>();
  a.kv_starts = nullptr;
  a.sinks = sinks ? sinks->data<float>() : nullptr;
  a.out = out.data<void>();
  a.dtype = q.dtype() == mx::float16 ? cpu::Dtype::float16
      : q.dtype() == mx::bfloat16    ? cpu::Dtype::bfloat16
                                     : cpu::Dtype::float32;
  a.B = q.shape(0);
  a.H_q = q.shape(1);
  a.H_kv = k.shape(2);
  a.G = a.H_q / a.H_kv;
  a.L = q.shape(2);
  a.T = tables.shape(1) * a.block_size;
  a.D = q.shape(3);
  a.Dp = cpu::padded_head_dim(a.D);
  a.window = effective_window(window_, a.T);
  // Pools [page, row, head, dim] as the kernel's {page, head, row, dim}.
  for (const auto& [from, to] : {std::pair{0, 0}, {2, 1}, {1, 2}, {3, 3}}) {
    a.k_stride[to] = k.strides(from);
    a.v_stride[to] = v.strides(from);
  }
  for (int i = 0; i < 4; ++i) {
    a.q_stride[i] = q.strides(i);
  }
  a.lens_stride = lens.strides(0);
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
