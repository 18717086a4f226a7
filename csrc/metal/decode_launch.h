// The one launch of the decode attention Metal kernels, shared by the
// eval_gpu of every op (eval_gpu.cpp): they differ in the row source only,
// which is the plan's PagedLayout, what is bound in the kv_starts slot, the
// quantized rows' kernel and extra buffers, and the ragged layout's table and
// groups of per-request buffers.
#pragma once

#include <string>

#include "mlx/array.h"
#include "mlx/stream.h"

#include "launch_plan.h"
#include "ragged_launch_plan.h"

namespace mlx_batched_decode {

namespace mx = mlx::core;

// The kernels' dtype of an array dtype; invalid_argument for others.
KernelDtype kernel_dtype(mx::Dtype dtype);

// invalid_argument, prefixed with op, unless a's last axis is contiguous, as the kernels read it.
void check_last_axis(const char* op, const mx::array& a, const std::string& name);

// The arrays bound at the kernels' input indices. kv_starts: the dense op's
// kv_starts, the paged op's block_tables, or valid_lens when absent; sinks,
// ring_offsets (the dense kernel's, at kRingOffsets) and query_starts (every
// kernel's, at kQueryStarts): valid_lens when absent (every argument needs a buffer).
struct DecodeBuffers {
  const mx::array& queries;
  const mx::array& keys;
  const mx::array& values;
  const mx::array& valid_lens;
  const mx::array& kv_starts;
  const mx::array& sinks;
  const mx::array& ring_offsets;
  const mx::array& query_starts;
};

// What quantized rows add to a launch: keys and values are the packed words,
// these the scales and biases of keys ([0]) and values ([1]).
struct QuantizedBuffers {
  int bits, group_size;
  const mx::array& key_scales;
  const mx::array& key_biases;
  const mx::array& value_scales;
  const mx::array& value_biases;
};

// What the ragged layout adds to a launch: its table and groups
// (make_ragged_layout) and the B keys and B values its groups' slots name
// (in.keys and in.values are then unused).
struct RaggedBuffers {
  const RaggedLayout& layout;
  const mx::array* keys;
  const mx::array* values;
};

// Plans (with the pipelines' thread limits), allocates out and encodes both
// passes on s. primitive names the command buffer's label; softcap 0 caps no
// score (DecodeAttributes::softcap); quantized, if set, selects the quantized
// main kernel and binds its buffers; ragged, if set, the ragged main kernel,
// dispatched once per group of requests.
void launch_decode_attention(const mx::Stream& s, const char* primitive, const LaunchShape& shape,
                             const InputStrides& strides, const InputOffsets& offsets, const PagedLayout& paged,
                             float scale, float softcap, const DecodeBuffers& in, mx::array& out,
                             const QuantizedBuffers* quantized = nullptr, const RaggedBuffers* ragged = nullptr);

} // namespace mlx_batched_decode
