// The quantized op function (checks, graph construction) and the primitive's
// device-independent methods. eval_cpu lives in cpu/, eval_gpu in metal/.
#include "quantized_batched_decode_attention.h"

#include <stdexcept>
#include <string>

#include "arguments.h"
#include "batched_decode_attention.h"
#include "mlx/ops.h"
#include "mlx/transforms.h"

namespace mlx_batched_decode {

namespace {

constexpr const char* kOp = "quantized_batched_decode_attention";

[[noreturn]] void fail(const std::string& what) {
  fail_argument(kOp, what);
}

// One (packed, scales, biases) triple of a [B, H_kv, T, D] tensor.
void check_triple(const std::vector<mx::array>& triple, const std::string& name, const mx::Shape& rows, int D,
                  int group_size, int bits) {
  if (triple.size() != 3) {
    fail(name + " must be a (packed, scales, biases) triple as mx.quantize returns, got " +
         std::to_string(triple.size()) + " arrays.");
  }
  const mx::array& packed = triple[0];
  const mx::array& scales = triple[1];
  const mx::array& biases = triple[2];
  if (packed.ndim() != 4 || scales.ndim() != 4 || biases.ndim() != 4) {
    fail(name + ": packed, scales and biases must have 4 dimensions [B, H_kv, T, ...], got " +
         shape_str(packed) + ", " + shape_str(scales) + " and " + shape_str(biases) + ".");
  }
  if (packed.dtype() != mx::uint32) {
    fail(name + ": packed must be uint32, got " + dtype_str(packed.dtype()) + ".");
  }
  const mx::Shape words = {rows[0], rows[1], rows[2], D * bits / 32};
  const mx::Shape groups = {rows[0], rows[1], rows[2], D / group_size};
  if (packed.shape() != words) {
    fail(name + ": packed must have shape [B, H_kv, T, D * bits / 32] = " + shape_str(mx::zeros(words)) +
         ", got " + shape_str(packed) + ".");
  }
  if (scales.shape() != groups || biases.shape() != groups) {
    fail(name + ": scales and biases must have shape [B, H_kv, T, D / group_size] = " +
         shape_str(mx::zeros(groups)) + ", got " + shape_str(scales) + " and " + shape_str(biases) + ".");
  }
  if (!is_supported_dtype(scales.dtype()) || biases.dtype() != scales.dtype()) {
    fail(name + ": scales and biases must share one of float16, bfloat16 and float32, got " +
         dtype_str(scales.dtype()) + " and " + dtype_str(biases.dtype()) + ".");
  }
}

DecodeShape check_quantized_arguments(
    const mx::array& queries,
    const std::vector<mx::array>& keys,
    const std::vector<mx::array>& values,
    const mx::array& valid_lens,
    int group_size,
    int bits,
    std::optional<float> scale,
    const std::optional<mx::array>& kv_starts,
    std::optional<int> window,
    const std::optional<mx::array>& sinks) {
  if (queries.ndim() != 4) {
    fail("queries must have shape [B, H_q, L, D], got " + shape_str(queries) + ".");
  }
  if (!is_supported_dtype(queries.dtype())) {
    fail("queries must be float16, bfloat16 or float32, got " + dtype_str(queries.dtype()) + ".");
  }
  if (bits != 4 && bits != 8) {
    fail("bits must be 4 or 8, got " + std::to_string(bits) + ".");
  }
  if (group_size != 32 && group_size != 64 && group_size != 128) {
    fail("group_size must be 32, 64 or 128, got " + std::to_string(group_size) + ".");
  }
  DecodeShape d{queries.shape(0), queries.shape(1), 0, 0, queries.shape(2), 0, queries.shape(3)};
  if (d.L < 1) {
    fail("queries must have at least one row per request (L >= 1), got " + shape_str(queries) + ".");
  }
  if (d.D < 1 || d.D > kMaxHeadDim || d.D % group_size != 0) {
    fail("head dim " + std::to_string(d.D) + " is not supported with group_size " + std::to_string(group_size) +
         "; multiples of group_size up to " + std::to_string(kMaxHeadDim) + " are.");
  }
  if (keys.size() == 3 && keys[0].ndim() == 4) {
    d.H_kv = keys[0].shape(1);
    d.T = keys[0].shape(2);
  }
  const mx::Shape rows = {d.B, d.H_kv, d.T};
  check_triple(keys, "keys", rows, d.D, group_size, bits);
  check_triple(values, "values", rows, d.D, group_size, bits);
  if (values[1].dtype() != keys[1].dtype()) {
    fail("the scales of keys and values must share one dtype, got " + dtype_str(keys[1].dtype()) + " and " +
         dtype_str(values[1].dtype()) + ".");
  }
  if (d.H_q < 1 || d.H_kv < 1 || d.H_q % d.H_kv != 0) {
    fail("the number of query heads (" + std::to_string(d.H_q) +
         ") must be a positive multiple of the number of key/value heads (" + std::to_string(d.H_kv) + ").");
  }
  d.G = d.H_q / d.H_kv;
  check_options(kOp, d, valid_lens, scale, kv_starts, window, sinks);
  return d;
}

// x as mx.dequantize gives it, in float32.
mx::array dequantized(const mx::array& packed, const mx::array& scales, const mx::array& biases, int group_size,
                      int bits, mx::StreamOrDevice s) {
  return mx::dequantize(packed, mx::astype(scales, mx::float32, s), mx::astype(biases, mx::float32, s), group_size,
                        bits, "affine", std::nullopt, std::nullopt, s);
}

} // namespace

mx::array quantized_batched_decode_attention(
    const mx::array& queries,
    const std::vector<mx::array>& keys,
    const std::vector<mx::array>& values,
    const mx::array& valid_lens,
    int group_size,
    int bits,
    std::optional<float> scale,
    const std::optional<mx::array>& kv_starts,
    std::optional<int> window,
    const std::optional<mx::array>& sinks,
    mx::StreamOrDevice s) {
  const DecodeShape d = check_quantized_arguments(
      queries, keys, values, valid_lens, group_size, bits, scale, kv_starts, window, sinks);
  auto stream = mx::to_stream(s);
#if !defined(MLX_BATCHED_DECODE_METAL)
  if (stream.device == mx::Device::gpu) {
    throw std::invalid_argument(
        "[quantized_batched_decode_attention] this build has no Metal kernel; run it on a CPU stream.");
  }
#endif
  std::vector<mx::array> inputs = {queries, keys[0], keys[1], keys[2], values[0], values[1], values[2],
                                   positions_as_int32(valid_lens, d.T, stream)};
  if (kv_starts) {
    inputs.push_back(positions_as_int32(*kv_starts, d.T, stream));
  }
  if (sinks) {
    inputs.push_back(mx::astype(*sinks, mx::float32, stream));
  }
  return mx::array(
      queries.shape(),
      queries.dtype(),
      std::make_shared<QuantizedBatchedDecodeAttention>(
          stream, resolve_scale(scale, d.D), window.value_or(0), kv_starts.has_value(), sinks.has_value(),
          group_size, bits),
      std::move(inputs));
}

std::vector<mx::array> QuantizedBatchedDecodeAttention::fallback(const std::vector<mx::array>& inputs) {
  const auto s = stream();
  int next = kQuantOptions;
  std::optional<mx::array> kv_starts;
  std::optional<mx::array> sinks;
  if (has_kv_starts_) {
    kv_starts = inputs[next++];
  }
  if (has_sinks_) {
    sinks = inputs[next++];
  }
  const mx::array k = dequantized(inputs[kKeyWords], inputs[kKeyScales], inputs[kKeyBiases], group_size_, bits_, s);
  const mx::array v =
      dequantized(inputs[kValueWords], inputs[kValueScales], inputs[kValueBiases], group_size_, bits_, s);
  const mx::array& q = inputs[kQuantQueries];
  return {mx::astype(
      reference_attention(mx::astype(q, mx::float32, s), k, v, inputs[kQuantValidLens], scale_, kv_starts,
                          window_ > 0 ? std::optional<int>(window_) : std::nullopt, sinks, s),
      q.dtype(), s)};
}

// The transformations differentiate the fallback in the arguments asked for
// only: the packed integers have no derivative.
std::vector<mx::array> QuantizedBatchedDecodeAttention::vjp(
    const std::vector<mx::array>& primals,
    const std::vector<mx::array>& cotangents,
    const std::vector<int>& argnums,
    const std::vector<mx::array>&) {
  std::vector<mx::array> chosen;
  for (int i : argnums) {
    chosen.push_back(primals[i]);
  }
  auto f = [&](const std::vector<mx::array>& in) {
    std::vector<mx::array> all = primals;
    for (size_t k = 0; k < argnums.size(); ++k) {
      all[argnums[k]] = in[k];
    }
    return fallback(all);
  };
  return mx::vjp(f, chosen, cotangents).second;
}

std::vector<mx::array> QuantizedBatchedDecodeAttention::jvp(
    const std::vector<mx::array>& primals,
    const std::vector<mx::array>& tangents,
    const std::vector<int>& argnums) {
  std::vector<mx::array> chosen;
  for (int i : argnums) {
    chosen.push_back(primals[i]);
  }
  auto f = [&](const std::vector<mx::array>& in) {
    std::vector<mx::array> all = primals;
    for (size_t k = 0; k < argnums.size(); ++k) {
      all[argnums[k]] = in[k];
    }
    return fallback(all);
  };
  return mx::jvp(f, chosen, tangents).second;
}

std::pair<std::vector<mx::array>, std::vector<int>> QuantizedBatchedDecodeAttention::vmap(
    const std::vector<mx::array>& inputs,
    const std::vector<int>& axes) {
  auto f = [this](const std::vector<mx::array>& in) { return fallback(in); };
  return {mx::vmap(f, axes)(inputs), {0}};
}

bool QuantizedBatchedDecodeAttention::is_equivalent(const mx::Primitive& other) const {
  const auto& o = static_cast<const QuantizedBatchedDecodeAttention&>(other);
  return state() == o.state();
}

std::vector<mx::Shape> QuantizedBatchedDecodeAttention::output_shapes(const std::vector<mx::array>& inputs) {
  return {inputs[kQuantQueries].shape()};
}

#if !defined(MLX_BATCHED_DECODE_METAL)
void QuantizedBatchedDecodeAttention::eval_gpu(const std::vector<mx::array>&, mx::array&) {
  // Unreachable through the op function, which rejects GPU streams in this build.
  throw std::runtime_error("[quantized_batched_decode_attention] this build has no Metal kernel.");
}
#endif

} // namespace mlx_batched_decode
