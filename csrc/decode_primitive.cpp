// The family's shared primitive methods: the transformations through the
// fallback, equivalence, output shapes, and a call's inputs.
#include "decode_primitive.h"

#include <stdexcept>
#include <string>
#include <typeinfo>

#include "arguments.h"
#include "mlx/ops.h"
#include "mlx/transforms.h"

namespace mlx_batched_decode {

namespace {

// f as a function of the inputs at argnums, the others held at primals:
// only those are differentiated (integer inputs, lengths and packed words
// among them, have no derivative).
template <typename F>
auto of_chosen(F f, const std::vector<mx::array>& primals, const std::vector<int>& argnums) {
  return [f, &primals, &argnums](const std::vector<mx::array>& chosen) {
    std::vector<mx::array> all = primals;
    for (size_t k = 0; k < argnums.size(); ++k) {
      all[argnums[k]] = chosen[k];
    }
    return f(all);
  };
}

std::vector<mx::array> at(const std::vector<mx::array>& arrays, const std::vector<int>& indices) {
  std::vector<mx::array> out;
  for (int i : indices) {
    out.push_back(arrays[i]);
  }
  return out;
}

} // namespace

DecodeOptions DecodePrimitive::options(const std::vector<mx::array>& inputs) const {
  DecodeOptions o;
  o.scale = attributes_.scale;
  if (attributes_.window > 0) {
    o.window = attributes_.window;
  }
  if (const mx::array* starts = kv_starts(inputs)) {
    o.kv_starts = *starts;
  }
  if (const mx::array* s = sinks(inputs)) {
    o.sinks = *s;
  }
  if (const mx::array* r = ring_offset(inputs)) {
    o.ring_offset = *r;
  }
  if (attributes_.softcap > 0.0f) {
    o.softcap = attributes_.softcap;
  }
  if (const mx::array* q = query_starts(inputs)) {
    o.query_starts = *q;
  }
  return o;
}

mx::array DecodePrimitive::call_queries(const std::vector<mx::array>& inputs) {
  return attributes_.has_query_starts ? packed_queries(inputs[0], stream()) : inputs[0];
}

std::vector<mx::array> DecodePrimitive::vjp(const std::vector<mx::array>& primals,
                                            const std::vector<mx::array>& cotangents, const std::vector<int>& argnums,
                                            const std::vector<mx::array>&) {
  return mx::vjp(of_chosen(fallback_fn(), primals, argnums), at(primals, argnums), cotangents).second;
}

std::vector<mx::array> DecodePrimitive::jvp(const std::vector<mx::array>& primals,
                                            const std::vector<mx::array>& tangents, const std::vector<int>& argnums) {
  return mx::jvp(of_chosen(fallback_fn(), primals, argnums), at(primals, argnums), tangents).second;
}

std::pair<std::vector<mx::array>, std::vector<int>> DecodePrimitive::vmap(const std::vector<mx::array>& inputs,
                                                                          const std::vector<int>& axes) {
  return {mx::vmap(fallback_fn(), axes)(inputs), {0}};
}

bool DecodePrimitive::is_equivalent(const mx::Primitive& other) const {
  return typeid(*this) == typeid(other) &&
      attributes_ == static_cast<const DecodePrimitive&>(other).attributes_;
}

std::vector<mx::Shape> DecodePrimitive::output_shapes(const std::vector<mx::array>& inputs) {
  const mx::array& q = inputs[0];
  const int Dv = value_dim(inputs);
  if (attributes_.has_query_starts) {
    return {{q.shape(2), q.shape(1), Dv}};
  }
  return {{q.shape(0), q.shape(1), q.shape(2), Dv}};
}

DecodeCall decode_call(const char* op, std::vector<mx::array> rows, const mx::array& valid_lens,
                       const DecodeOptions& options, int T, int D, mx::StreamOrDevice s, int group_size, int bits) {
  const mx::Stream stream = mx::to_stream(s);
#if !defined(MLX_BATCHED_DECODE_METAL)
  if (stream.device == mx::Device::gpu) {
    fail_argument(op, "this build has no Metal kernel; run it on a CPU stream.");
  }
#endif
  std::vector<mx::array> inputs = std::move(rows);
  inputs.push_back(positions_as_int32(valid_lens, T, stream));
  if (options.kv_starts) {
    inputs.push_back(positions_as_int32(*options.kv_starts, T, stream));
  }
  if (options.sinks) {
    inputs.push_back(mx::astype(*options.sinks, mx::float32, stream));
  }
  if (options.ring_offset) {
    inputs.push_back(ring_offsets_as_int32(*options.ring_offset, inputs[0].shape(0), T, stream));
  }
  if (options.query_starts) {
    // The queries are the [B, H_q, N, D] view: its rows bound every start.
    inputs.push_back(positions_as_int32(*options.query_starts, inputs[0].shape(2), stream));
  }
  const DecodeAttributes attributes{
      resolve_scale(options.scale, D), options.window.value_or(0), options.kv_starts.has_value(),
      options.sinks.has_value(), group_size, bits, options.ring_offset.has_value(), options.softcap.value_or(0.0f),
      options.query_starts.has_value()};
  return {stream, attributes, std::move(inputs)};
}

#if !defined(MLX_BATCHED_DECODE_METAL)
// Unreachable through the op functions, which reject GPU streams in this build.
[[noreturn]] void no_metal_kernel(const char* primitive) {
  throw std::runtime_error(std::string("[") + primitive + "] this build has no Metal kernel.");
}
void BatchedDecodeAttention::eval_gpu(const std::vector<mx::array>&, mx::array&) {
  no_metal_kernel(name());
}
void PagedDecodeAttention::eval_gpu(const std::vector<mx::array>&, mx::array&) {
  no_metal_kernel(name());
}
void QuantizedBatchedDecodeAttention::eval_gpu(const std::vector<mx::array>&, mx::array&) {
  no_metal_kernel(name());
}
void RaggedDecodeAttention::eval_gpu(const std::vector<mx::array>&, mx::array&) {
  no_metal_kernel(name());
}
#endif

} // namespace mlx_batched_decode
