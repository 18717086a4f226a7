// Metal launcher of BatchedDecodeAttention. Compiled only where MLX_BUILD_METAL
// is set (cmake/metal.cmake); the kernels live in csrc/kernels/, the launch
// plan in launch_plan.h, shared with the Linux emulation harness.
#include <dlfcn.h>

#include <cstdint>
#include <filesystem>
#include <stdexcept>
#include <string>
#include <vector>

#include "mlx/allocator.h"
#include "mlx/backend/metal/device.h"
#include "mlx/backend/metal/utils.h"

#include "../batched_decode_attention.h"
#include "launch_plan.h"

namespace mx = mlx::core;

namespace mlx_batched_decode {
namespace {

// The metallib is installed next to the extension module: find that directory.
const std::string& module_dir() {
  static const std::string dir = [] {
    Dl_info info;
    if (!dladdr(reinterpret_cast<void*>(&module_dir), &info)) {
      throw std::runtime_error("[batched_decode_attention] cannot locate the extension module on disk");
    }
    return std::filesystem::path(info.dli_fname).parent_path().string();
  }();
  return dir;
}

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

// Vector loads need every row start aligned to the vector width.
void check_alignment(const mx::array& a, const char* name, int vector_width) {
  if (a.strides().back() != 1) {
    throw std::invalid_argument(std::string("[batched_decode_attention] ") + name + ": last axis must be contiguous");
  }
  // Metal buffers start page-aligned, so the view's byte offset decides.
  if (a.offset() % (int64_t(vector_width) * int64_t(a.itemsize())) != 0) {
    throw std::invalid_argument(
        std::string("[batched_decode_attention] ") + name + ": data must start at a multiple of " +
        std::to_string(vector_width) + " elements for the Metal kernel");
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
  const mx::Stream& s = stream();
  mx::metal::Device& d = mx::metal::device(s.device);

  const int T = keys.shape(2);
  LaunchShape shape{
      queries.shape(0), queries.shape(1), keys.shape(1), queries.shape(2), T, queries.shape(3),
      effective_window(window_, T), kernel_dtype(queries.dtype()),
      /* max_threads_per_group, set below */ MBD_SIMD_WIDTH, has_kv_starts_, has_sinks_};
  MTL::Library* library = d.get_library("mlx_batched_decode", module_dir());
  // Names and function constants don't depend on the thread limit, which comes from the pipeline.
  const LaunchPlan provisional = make_launch_plan(shape);
  int rows = provisional.rows_per_group;
  const mx::metal::MTLFCList constants = {{&rows, MTL::DataType::DataTypeInt, MBD_FC_ROWS}};
  MTL::ComputePipelineState* kernel = d.get_kernel(
      provisional.kernel, library, provisional.kernel + "_rows" + std::to_string(rows), constants);
  shape.max_threads_per_group = int(kernel->maxTotalThreadsPerThreadgroup());
  const LaunchPlan plan = make_launch_plan(shape);
  mx::check_kernel_threadgroup_size(kernel, to_mtl(plan.group), plan.kernel);

  check_alignment(queries, "queries", plan.vector_width);
  check_alignment(keys, "keys", plan.vector_width);
  check_alignment(values, "values", plan.vector_width);
  const InputStrides strides{queries.strides(0), queries.strides(1), queries.strides(2),
                             keys.strides(0),    keys.strides(1),    keys.strides(2),
                             values.strides(0),  values.strides(1),  values.strides(2),
                             valid_lens.strides(0), kv_starts.strides(0), sinks.strides(0)};
  const BatchedDecodeParams params = make_params(shape, plan, strides, scale_);

  out.set_data(mx::allocator::malloc(out.nbytes()));

  auto& encoder = mx::metal::get_command_encoder(s);
  // Captures show the kernel names; the command buffer label adds the primitive.
  if (MTL::CommandBuffer* buffer = encoder.get_command_buffer()) {
    std::string label = buffer->label() ? buffer->label()->utf8String() : "";
    label += label.empty() ? name() : std::string(" ") + name();
    buffer->setLabel(NS::String::string(label.c_str(), NS::UTF8StringEncoding));
  }

  const bool split = plan.num_splits > 1;
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
    MTL::ComputePipelineState* reduce = d.get_kernel(plan.reduce_kernel, library);
    mx::check_kernel_threadgroup_size(reduce, to_mtl(plan.reduce_group), plan.reduce_kernel);
    encoder.set_compute_pipeline_state(reduce);
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
