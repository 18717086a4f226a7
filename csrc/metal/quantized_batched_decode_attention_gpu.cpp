// Metal launcher of QuantizedBatchedDecodeAttention. Compiled only where
// MLX_BUILD_METAL is set (cmake/metal.cmake). The kernel is the dense one's
// core with the quantized row source (csrc/kernels), launched by the dense
// plan with the quantized main kernel (quantized_launch_plan.h); the split-K
// reduce is the dense one.
#include <cstdint>
#include <stdexcept>
#include <string>
#include <vector>

#include "mlx/allocator.h"
#include "mlx/backend/metal/device.h"
#include "mlx/backend/metal/utils.h"

#include "../batched_decode_attention.h"
#include "../metal_backend.h"
#include "../metal_source.h"
#include "../quantized_batched_decode_attention.h"
#include "kernel_library.h"
#include "quantized_launch_plan.h"

namespace mx = mlx::core;

namespace mlx_batched_decode {
namespace {

KernelDtype kernel_dtype(mx::Dtype dtype) {
  if (dtype == mx::float16) {
    return KernelDtype::float16;
  }
  if (dtype == mx::bfloat16) {
    return KernelDtype::bfloat16;
  }
  return KernelDtype::float32;
}

// The library holding the quantized kernel of (dtype, D, bits) and the reduce of (dtype, D).
MTL::Library* quantized_library(mx::metal::Device& d, KernelDtype dtype, int head_dim, int bits) {
  switch (metal_backend()) {
    case MetalBackend::metallib:
      return d.get_library(kMetallibName, module_dir());
    case MetalBackend::source:
      break;
    case MetalBackend::none:
      throw std::runtime_error("[quantized_batched_decode_attention] Metal is not available");
  }
  const std::string name = quantized_library_name(metal_source_hash(), dtype, head_dim, bits);
  try {
    return d.get_library(
        name, mx::CompileOptions{}, [&] { return quantized_library_source(metal_source(), dtype, head_dim, bits); });
  } catch (const std::exception& e) {
    throw std::runtime_error("[quantized_batched_decode_attention] compiling the Metal kernels " +
                             quantized_kernel_name(dtype, head_dim, bits) + " from source failed: " + e.what());
  }
}

MTL::Size to_mtl(const Size3& s) {
  return MTL::Size(s.x, s.y, s.z);
}

} // namespace

void QuantizedBatchedDecodeAttention::eval_gpu(const std::vector<mx::array>& inputs, mx::array& out) {
  const mx::array& queries = inputs[kQuantQueries];
  const mx::array& keys = inputs[kKeyWords];
  const mx::array& values = inputs[kValueWords];
  const mx::array& valid_lens = inputs[kQuantValidLens];
  // Absent options are bound to valid_lens (every argument needs a buffer); the params say they are absent.
  const mx::array& kv_starts = has_kv_starts_ ? inputs[kQuantOptions] : valid_lens;
  const mx::array& sinks = has_sinks_ ? inputs[kQuantOptions + int(has_kv_starts_)] : valid_lens;
  if (out.size() == 0) {
    out.set_data(mx::allocator::malloc(0));
    return;
  }
  for (const mx::array* a : {&queries, &keys, &values}) {
    if (a->strides().back() != 1) {
      throw std::invalid_argument(
          "[quantized_batched_decode_attention] the Metal kernel needs a contiguous last axis of the queries and "
          "packed words");
    }
  }
  const mx::Stream& s = stream();
  mx::metal::Device& d = mx::metal::device(s.device);
  const int T = keys.shape(2);
  LaunchShape shape{
      queries.shape(0), queries.shape(1), keys.shape(1), queries.shape(2), T, queries.shape(3),
      effective_window(window_, T), kernel_dtype(queries.dtype()), MBD_SIMD_WIDTH, has_kv_starts_, has_sinks_};
  const InputStrides strides{queries.strides(0), queries.strides(1), queries.strides(2),
                             keys.strides(0),    keys.strides(1),    keys.strides(2),
                             values.strides(0),  values.strides(1),  values.strides(2),
                             valid_lens.strides(0), kv_starts.strides(0), sinks.strides(0)};
  QuantizedStrides qstrides{};
  const int scale_inputs[2][2] = {{kKeyScales, kKeyBiases}, {kValueScales, kValueBiases}};
  for (int side = 0; side < 2; ++side) {
    for (int axis = 0; axis < 4; ++axis) {
      qstrides.scales[side][axis] = inputs[scale_inputs[side][0]].strides(axis);
      qstrides.biases[side][axis] = inputs[scale_inputs[side][1]].strides(axis);
    }
  }

  const LaunchPlan provisional = make_quantized_launch_plan(shape, bits_, group_size_);
  int rows = provisional.rows_per_group;
  bool vectors = quantized_vector_loads(shape, provisional, strides, queries.offset());
  MTL::Library* library = quantized_library(d, shape.dtype, shape.head_dim, bits_);
  const mx::metal::MTLFCList constants = {
      {&rows, MTL::DataType::DataTypeInt, MBD_FC_ROWS},
      {&vectors, MTL::DataType::DataTypeBool, MBD_FC_VECTOR_LOADS}};
  MTL::ComputePipelineState* kernel = d.get_kernel(
      provisional.kernel, library,
      provisional.kernel + "_rows" + std::to_string(rows) + (vectors ? "_vector" : "_scalar"), constants);
  shape.max_threads_per_group = int(kernel->maxTotalThreadsPerThreadgroup());
  const LaunchPlan plan = make_quantized_launch_plan(shape, bits_, group_size_);
  mx::check_kernel_threadgroup_size(kernel, to_mtl(plan.group), plan.kernel);
  const bool split = plan.num_splits > 1;
  MTL::ComputePipelineState* reduce = split ? d.get_kernel(plan.reduce_kernel, library) : nullptr;
  if (split) {
    mx::check_kernel_threadgroup_size(reduce, to_mtl(plan.reduce_group), plan.reduce_kernel);
  }
  const BatchedDecodeParams params = make_params(shape, plan, strides, scale_);
  const QuantizedDecodeParams qparams =
      make_quantized_params(shape, qstrides, group_size_, kernel_dtype(inputs[kKeyScales].dtype()));

  out.set_data(mx::allocator::malloc(out.nbytes()));
  auto& encoder = mx::metal::get_command_encoder(s);
  std::vector<mx::array> partials;
  if (split) {
    partials.emplace_back(mx::Shape{int(plan.partial_acc_elems)}, mx::float32, nullptr, std::vector<mx::array>{});
    partials.emplace_back(mx::Shape{int(plan.partial_stats_elems)}, mx::float32, nullptr, std::vector<mx::array>{});
    partials.emplace_back(mx::Shape{int(plan.partial_stats_elems)}, mx::float32, nullptr, std::vector<mx::array>{});
    for (mx::array& p : partials) {
      p.set_data(mx::allocator::malloc(p.nbytes()));
      encoder.add_temporary(p);
    }
  }

  encoder.set_compute_pipeline_state(kernel);
  encoder.set_input_array(queries, kQueries);
  encoder.set_input_array(keys, kKeys);
  encoder.set_input_array(values, kValues);
  encoder.set_input_array(valid_lens, kValidLens);
  encoder.set_input_array(kv_starts, kKvStarts);
  encoder.set_input_array(sinks, kSinks);
  encoder.set_output_array(out, kOut);
  encoder.set_output_array(split ? partials[0] : out, kPartialAcc);
  encoder.set_output_array(split ? partials[1] : out, kPartialMax);
  encoder.set_output_array(split ? partials[2] : out, kPartialSum);
  encoder.set_bytes(params, kParams);
  encoder.set_input_array(inputs[kKeyScales], MBD_QUANT_KEY_SCALES);
  encoder.set_input_array(inputs[kKeyBiases], MBD_QUANT_KEY_BIASES);
  encoder.set_input_array(inputs[kValueScales], MBD_QUANT_VALUE_SCALES);
  encoder.set_input_array(inputs[kValueBiases], MBD_QUANT_VALUE_BIASES);
  encoder.set_bytes(qparams, MBD_QUANT_PARAMS);
  encoder.dispatch_threadgroups(to_mtl(plan.grid), to_mtl(plan.group));

  if (split) {
    encoder.set_compute_pipeline_state(reduce);
    encoder.set_input_array(valid_lens, kValidLens);
    encoder.set_input_array(kv_starts, kKvStarts);
    encoder.set_input_array(sinks, kSinks);
    encoder.set_output_array(out, kOut);
    encoder.set_input_array(partials[0], kPartialAcc);
    encoder.set_input_array(partials[1], kPartialMax);
    encoder.set_input_array(partials[2], kPartialSum);
    encoder.set_bytes(params, kParams);
    encoder.dispatch_threadgroups(to_mtl(plan.reduce_grid), to_mtl(plan.reduce_group));
  }
}

} // namespace mlx_batched_decode
