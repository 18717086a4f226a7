// The launch tail of the decode attention Metal kernels: library, pipelines,
// bindings and dispatch of both passes. Compiled only where MLX_BUILD_METAL
// is set (cmake/metal.cmake); the kernels live in csrc/kernels/, the launch
// plan in launch_plan.h and the run-time libraries in kernel_library.h, both
// shared with the Linux emulation harness.
#include <cstdint>
#include <cstring>
#include <stdexcept>
#include <string>
#include <vector>

#include "mlx/allocator.h"
#include "mlx/backend/metal/device.h"
#include "mlx/backend/metal/utils.h"

#include "../metal_backend.h"
#include "../metal_source.h"
#include "decode_launch.h"
#include "kernel_library.h"
#include "launch_plan.h"
#include "quantized_launch_plan.h"
#include "ragged_launch_plan.h"

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

void check_last_axis(const char* op, const mx::array& a, const std::string& name) {
  if (a.strides().back() != 1) {
    throw std::invalid_argument("[" + std::string(op) + "] " + name + ": last axis must be contiguous");
  }
}

namespace {

// The source of the run-time library of (dtype, D, Dv), with the quantized main
// kernel of `bits` when bits != 0, or the ragged main kernel.
std::string kernel_source(KernelDtype dtype, int head_dim, int value_dim, int bits, bool ragged) {
  if (ragged) {
    return ragged_library_source(metal_source(), dtype, head_dim, value_dim);
  }
  return bits ? quantized_library_source(metal_source(), dtype, head_dim, value_dim, bits)
              : library_source(metal_source(), dtype, head_dim, value_dim);
}

// The kernels of (dtype, D, Dv[, bits or ragged]): from the prebuilt metallib, or
// from the embedded source, compiled once per process at the first call of this
// dtype and head dims. A compile failure is an error, never a CPU fallback.
MTL::Library* kernel_library(mx::metal::Device& d, KernelDtype dtype, int head_dim, int value_dim, int bits,
                             bool ragged) {
  switch (metal_backend()) {
    case MetalBackend::metallib:
      return d.get_library(kMetallibName, module_dir());
    case MetalBackend::source:
      break;
    case MetalBackend::none:
      throw std::runtime_error("[batched_decode_attention] Metal is not available");
  }
  const std::string hash = metal_source_hash();
  const std::string name = ragged ? ragged_library_name(hash, dtype, head_dim, value_dim)
      : bits                        ? quantized_library_name(hash, dtype, head_dim, value_dim, bits)
                                    : library_name(hash, dtype, head_dim, value_dim);
  try {
    // MLX's safe math mode: the kernel needs IEEE infinities and NaN (as the metallib's -fno-fast-math).
    return d.get_library(name, mx::CompileOptions{}, [&] { return kernel_source(dtype, head_dim, value_dim, bits, ragged); });
  } catch (const std::exception& e) {
    throw std::runtime_error("[batched_decode_attention] compiling the Metal kernels " + name +
                             " from source failed: " + e.what());
  }
}

MTL::ComputePipelineState* pipeline(mx::metal::Device& d, const std::string& kernel, MTL::Library* library,
                                    const std::string& hash_name = "", const mx::metal::MTLFCList& constants = {}) {
  try {
    return d.get_kernel(kernel, library, hash_name, constants);
  } catch (const std::exception& e) {
    throw std::runtime_error("[batched_decode_attention] building the Metal pipeline " + kernel + " failed: " + e.what());
  }
}

MTL::Size to_mtl(const Size3& s) {
  return MTL::Size(s.x, s.y, s.z);
}

// The plan of the main kernel the row source needs, for the pipelines' thread limits.
LaunchPlan plan_for(const LaunchShape& shape, const ThreadLimits& limits, const QuantizedBuffers* quantized,
                    const RaggedBuffers* ragged) {
  if (ragged) {
    return make_ragged_launch_plan(shape, limits);
  }
  return quantized ? make_quantized_launch_plan(shape, limits, quantized->bits, quantized->group_size)
                   : make_launch_plan(shape, limits);
}

// The ragged layout's table as a buffer the command buffer keeps until it completes.
mx::array request_table(const RaggedLayout& layout, mx::metal::CommandEncoder& encoder) {
  const size_t bytes = layout.table.size() * sizeof(RaggedRequest);
  mx::array table(mx::Shape{int(bytes)}, mx::uint8, nullptr, std::vector<mx::array>{});
  table.set_data(mx::allocator::malloc(bytes));
  std::memcpy(table.data<void>(), layout.table.data(), bytes);
  encoder.add_temporary(table);
  return table;
}

// Binds group g's buffers at the slots (each at its buffer's start: the table's
// offsets count from there) and its first request; unused slots hold valid_lens.
void bind_group(mx::metal::CommandEncoder& encoder, const RaggedBuffers& ragged, const RaggedGroup& g,
                const mx::array& valid_lens) {
  const int B = int(ragged.layout.table.size());
  for (int s = 0; s < kRaggedSlots; ++s) {
    if (s < int(g.slots.size())) {
      const int i = g.slots[s];
      const mx::array& a = i < B ? ragged.keys[i] : ragged.values[i - B];
      encoder.set_input_array(a, kRaggedSlot0 + s, -a.offset());
    } else {
      encoder.set_input_array(valid_lens, kRaggedSlot0 + s);
    }
  }
  encoder.set_bytes(RaggedGroupParams{g.first, g.count}, kRaggedGroup);
}

} // namespace

void launch_decode_attention(const mx::Stream& s, const char* primitive, const LaunchShape& shape,
                             const InputStrides& strides, const InputOffsets& offsets, const PagedLayout& paged,
                             float scale, float softcap, const DecodeBuffers& in, mx::array& out,
                             const QuantizedBuffers* quantized, const RaggedBuffers* ragged) {
  if (shape.has_ring_offset && (paged.block_size > 0 || quantized || ragged)) {
    throw std::invalid_argument(std::string("[") + primitive + "] ring_offset is for the dense layout only");
  }
  mx::metal::Device& d = mx::metal::device(s.device);
  // Names and function constants don't depend on the thread limits, which come from the pipelines:
  // this plan assumes the least any pipeline allows.
  const LaunchPlan provisional = plan_for(shape, {MBD_SIMD_WIDTH, MBD_SIMD_WIDTH}, quantized, ragged);
  int rows = provisional.rows_per_group;
  bool tiled = provisional.tiled;
  // Packed rows are read a word per lane: only the queries' vectors count for them.
  bool vectors = ragged      ? ragged_vector_loads(shape, provisional, strides, offsets.q, ragged->layout)
      : quantized ? quantized_vector_loads(shape, provisional, strides, offsets.q)
                  : vector_loads(shape, provisional, strides, offsets, paged);
  MTL::Library* library = kernel_library(d, shape.dtype, shape.head_dim, value_head_dim(shape),
                                         quantized ? quantized->bits : 0, ragged != nullptr);
  const mx::metal::MTLFCList constants = {
      {&rows, MTL::DataType::DataTypeInt, MBD_FC_ROWS},
      {&vectors, MTL::DataType::DataTypeBool, MBD_FC_VECTOR_LOADS},
      {&tiled, MTL::DataType::DataTypeBool, MBD_FC_TILED}};
  MTL::ComputePipelineState* kernel = pipeline(
      d, provisional.kernel, library,
      provisional.kernel + "_rows" + std::to_string(rows) + (vectors ? "_vector" : "_scalar") +
          (tiled ? "_tiled" : ""),
      constants);
  // Each pipeline's own limit (registers decide it): the plan sizes both passes' threadgroups from them.
  const int main_limit = int(kernel->maxTotalThreadsPerThreadgroup());
  LaunchPlan plan = plan_for(shape, {main_limit, main_limit}, quantized, ragged);
  const bool split = plan.num_splits > 1;
  // Both pipelines before any encoding: a failure leaves no half-encoded work.
  MTL::ComputePipelineState* reduce = split ? pipeline(d, plan.reduce_kernel, library) : nullptr;
  if (split) {
    plan = plan_for(shape, {main_limit, int(reduce->maxTotalThreadsPerThreadgroup())}, quantized, ragged);
    mx::check_kernel_threadgroup_size(reduce, to_mtl(plan.reduce_group), plan.reduce_kernel);
  }
  // A plan that ignored a limit would launch nothing and leave zeros: MLX's check raises instead.
  mx::check_kernel_threadgroup_size(kernel, to_mtl(plan.group), plan.kernel);
  const BatchedDecodeParams params =
      ragged ? make_ragged_params(shape, plan, strides, scale, softcap)
             : make_params(shape, plan, strides, scale, softcap, paged);

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

  // Bound in both passes: the ragged table, or valid_lens for a reduce that does not read it.
  const mx::array requests = ragged ? request_table(ragged->layout, encoder) : in.valid_lens;

  encoder.set_compute_pipeline_state(kernel);
  encoder.set_input_array(in.queries, kQueries);
  if (ragged) {
    encoder.set_input_array(requests, kRequests);
  } else {
    encoder.set_input_array(in.keys, kKeys);
    encoder.set_input_array(in.values, kValues);
  }
  encoder.set_input_array(in.valid_lens, kValidLens);
  encoder.set_input_array(in.kv_starts, kKvStarts);
  encoder.set_input_array(in.sinks, kSinks);
  encoder.set_output_array(out, kOut);
  // Single pass never touches the partials, but every kernel argument must be bound.
  encoder.set_output_array(split ? partials[0] : out, kPartialAcc);
  encoder.set_output_array(split ? partials[1] : out, kPartialMax);
  encoder.set_output_array(split ? partials[2] : out, kPartialSum);
  encoder.set_bytes(params, kParams);
  encoder.set_input_array(in.query_starts, kQueryStarts);
  // The quantized and ragged kernels bind buffers of their own at this index.
  if (!quantized && !ragged) {
    encoder.set_input_array(in.ring_offsets, kRingOffsets);
  }
  if (quantized) {
    const mx::array* arrays[2][2] = {{&quantized->key_scales, &quantized->key_biases},
                                     {&quantized->value_scales, &quantized->value_biases}};
    QuantizedStrides qstrides{};
    for (int side = 0; side < 2; ++side) {
      for (int axis = 0; axis < 4; ++axis) {
        qstrides.scales[side][axis] = arrays[side][0]->strides(axis);
        qstrides.biases[side][axis] = arrays[side][1]->strides(axis);
      }
    }
    const QuantizedDecodeParams qparams =
        make_quantized_params(shape, qstrides, quantized->group_size, kernel_dtype(quantized->key_scales.dtype()));
    encoder.set_input_array(quantized->key_scales, MBD_QUANT_KEY_SCALES);
    encoder.set_input_array(quantized->key_biases, MBD_QUANT_KEY_BIASES);
    encoder.set_input_array(quantized->value_scales, MBD_QUANT_VALUE_SCALES);
    encoder.set_input_array(quantized->value_biases, MBD_QUANT_VALUE_BIASES);
    encoder.set_bytes(qparams, MBD_QUANT_PARAMS);
  }
  if (ragged) {
    for (size_t g = 0; g < ragged->layout.groups.size(); ++g) {
      bind_group(encoder, *ragged, ragged->layout.groups[g], in.valid_lens);
      // Later groups keep the first one's output bindings: registering, not
      // rebinding, them spares a barrier between groups (they write disjoint
      // rows) and keeps the one before the reduce.
      if (g > 0) {
        encoder.register_output_array(out);
        for (const mx::array& p : partials) {
          encoder.register_output_array(p);
        }
      }
      encoder.dispatch_threadgroups(to_mtl(ragged_group_grid(plan, ragged->layout.groups[g])), to_mtl(plan.group));
    }
  } else {
    encoder.dispatch_threadgroups(to_mtl(plan.grid), to_mtl(plan.group));
  }

  if (split) {
    encoder.set_compute_pipeline_state(reduce);
    encoder.set_input_array(in.valid_lens, kValidLens);
    encoder.set_input_array(in.kv_starts, kKvStarts);
    encoder.set_input_array(in.sinks, kSinks);
    encoder.set_output_array(out, kOut);
    encoder.set_input_array(partials[0], kPartialAcc);
    encoder.set_input_array(partials[1], kPartialMax);
    encoder.set_input_array(partials[2], kPartialSum);
    encoder.set_bytes(params, kParams);
    encoder.set_input_array(requests, kRequests);
    encoder.set_input_array(in.query_starts, kQueryStarts);
    encoder.dispatch_threadgroups(to_mtl(plan.reduce_grid), to_mtl(plan.reduce_group));
  }
}

} // namespace mlx_batched_decode
