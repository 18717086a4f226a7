// Metal launcher of BatchedDecodeAttention. Compiled only where MLX_BUILD_METAL
// is set (cmake/metal.cmake); the kernels live in csrc/kernels/, the launch
// plan in launch_plan.h and the run-time libraries in kernel_library.h, both
// shared with the Linux emulation harness.
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
#include "decode_launch.h"
#include "kernel_library.h"
#include "launch_plan.h"

namespace mx = mlx::core;

namespace mlx_batched_decode {
KernelDtype kernel_dtype(mx::Dtype dtype) {
  if (dtype == mx::float16) {
    return KernelDtype::float16;
  }
  if (dtype == mx::bfloat16) {
    return KernelDtype::bfloat16;
  }
  if (dtype == mx::float32) {
    return KernelDtype::float32;
  }
  throw std::invalid_argument("[batched_decode_attention] the Metal kernel takes float16, bfloat16 or float32");
}

void check_last_axis(const mx::array& a, const char* name) {
  if (a.strides().back() != 1) {
    throw std::invalid_argument(std::string("[batched_decode_attention] ") + name + ": last axis must be contiguous");
  }
}

namespace {

// The kernels of (dtype, D): from the prebuilt metallib, or from the embedded
// source, compiled once per process at the first call of this dtype and head
// dim. A compile failure is an error, never a CPU fallback.
MTL::Library* kernel_library(mx::metal::Device& d, KernelDtype dtype, int head_dim) {
  switch (metal_backend()) {
    case MetalBackend::metallib:
      return d.get_library(kMetallibName, module_dir());
    case MetalBackend::source:
      break;
    case MetalBackend::none:
      throw std::runtime_error("[batched_decode_attention] Metal is not available");
  }
  const std::string name = library_name(metal_source_hash(), dtype, head_dim);
  try {
    // MLX's safe math mode: the kernel needs IEEE infinities and NaN (as the metallib's -fno-fast-math).
    return d.get_library(name, mx::CompileOptions{}, [&] { return library_source(metal_source(), dtype, head_dim); });
  } catch (const std::exception& e) {
    throw std::runtime_error(
        "[batched_decode_attention] compiling the Metal kernels " + kernel_suffix(dtype, head_dim) +
        " from source failed: " + e.what());
  }
}

MTL::ComputePipelineState* pipeline(
    mx::metal::Device& d,
    const std::string& kernel,
    MTL::Library* library,
    const std::string& hash_name = "",
    const mx::metal::MTLFCList& constants = {}) {
  try {
    return d.get_kernel(kernel, library, hash_name, constants);
  } catch (const std::exception& e) {
    throw std::runtime_error("[batched_decode_attention] building the Metal pipeline " + kernel + " failed: " + e.what());
  }
}

MTL::Size to_mtl(const Size3& s) {
  return MTL::Size(s.x, s.y, s.z);
}

} // namespace

void BatchedDecodeAttention::eval_gpu(const std::vector<mx::array>& inputs, mx::array& out) {
  const mx::array& queries = inputs[0];
  const mx::array& keys = inputs[1];
  const mx::array& values = inputs[2];
  const mx::array& valid_lens = inputs[3];
  // Absent options are bound to valid_lens (every argument needs a buffer); the params say they are absent.
  const mx::array& kv_starts = has_kv_starts_ ? inputs[4] : valid_lens;
  const mx::array& sinks = has_sinks_ ? inputs[4 + int(has_kv_starts_)] : valid_lens;
  if (out.size() == 0) {  // B == 0: nothing to launch
    out.set_data(mx::allocator::malloc(0));
    return;
  }
  check_last_axis(queries, "queries");
  check_last_axis(keys, "keys");
  check_last_axis(values, "values");
  const int T = keys.shape(2);
  LaunchShape shape{
      queries.shape(0), queries.shape(1), keys.shape(1), queries.shape(2), T, queries.shape(3),
      effective_window(window_, T), kernel_dtype(queries.dtype()),
      /* max_threads_per_group, set below */ MBD_SIMD_WIDTH, has_kv_starts_, has_sinks_};
  const InputStrides strides{queries.strides(0), queries.strides(1), queries.strides(2),
                             keys.strides(0),    keys.strides(1),    keys.strides(2),
                             values.strides(0),  values.strides(1),  values.strides(2),
                             valid_lens.strides(0), kv_starts.strides(0), sinks.strides(0)};
  // Metal buffers start at least 16-byte aligned, so the views' byte offsets decide the vector loads.
  const InputOffsets offsets{queries.offset(), keys.offset(), values.offset()};

  launch_decode_attention(stream(), name(), shape, strides, offsets, PagedLayout{}, scale_,
                          {queries, keys, values, valid_lens, kv_starts, sinks}, out);
}

void launch_decode_attention(
    const mx::Stream& s,
    const char* primitive,
    LaunchShape shape,
    const InputStrides& strides,
    const InputOffsets& offsets,
    const PagedLayout& paged,
    float scale,
    const DecodeBuffers& in,
    mx::array& out) {
  mx::metal::Device& d = mx::metal::device(s.device);
  const mx::array& queries = in.queries;
  const mx::array& keys = in.keys;
  const mx::array& values = in.values;
  const mx::array& valid_lens = in.valid_lens;
  const mx::array& kv_starts = in.kv_starts;
  const mx::array& sinks = in.sinks;
  // Names and function constants don't depend on the thread limit, which comes from the pipeline.
  const LaunchPlan provisional = make_launch_plan(shape);
  int rows = provisional.rows_per_group;
  bool vectors = vector_loads(shape, provisional, strides, offsets, paged);
  MTL::Library* library = kernel_library(d, shape.dtype, shape.head_dim);
  const mx::metal::MTLFCList constants = {
      {&rows, MTL::DataType::DataTypeInt, MBD_FC_ROWS},
      {&vectors, MTL::DataType::DataTypeBool, MBD_FC_VECTOR_LOADS}};
  MTL::ComputePipelineState* kernel = pipeline(
      d, provisional.kernel, library,
      provisional.kernel + "_rows" + std::to_string(rows) + (vectors ? "_vector" : "_scalar"), constants);
  shape.max_threads_per_group = int(kernel->maxTotalThreadsPerThreadgroup());
  const LaunchPlan plan = make_launch_plan(shape);
  mx::check_kernel_threadgroup_size(kernel, to_mtl(plan.group), plan.kernel);
  const bool split = plan.num_splits > 1;
  // Both pipelines before any encoding: a failure leaves no half-encoded work.
  MTL::ComputePipelineState* reduce = split ? pipeline(d, plan.reduce_kernel, library) : nullptr;
  if (split) {
    mx::check_kernel_threadgroup_size(reduce, to_mtl(plan.reduce_group), plan.reduce_kernel);
  }
  const BatchedDecodeParams params = make_params(shape, plan, strides, scale, paged);

  out.set_data(mx::allocator::malloc(out.nbytes()));

  auto& encoder = mx::metal::get_command_encoder(s);
  // Captures show the kernel names; the command buffer label adds the primitive.
  if (MTL::CommandBuffer* buffer = encoder.get_command_buffer()) {
    std::string label = buffer->label() ? buffer->label()->utf8String() : "";
    label += label.empty() ? std::string(primitive) : std::string(" ") + primitive;
    buffer->setLabel(NS::String::string(label.c_str(), NS::UTF8StringEncoding));
  }

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
  // Single pass never touches the partials, but every kernel argument must be bound.
  encoder.set_output_array(split ? partials[0] : out, kPartialAcc);
  encoder.set_output_array(split ? partials[1] : out, kPartialMax);
  encoder.set_output_array(split ? partials[2] : out, kPartialSum);
  encoder.set_bytes(params, kParams);
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
