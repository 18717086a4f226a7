// The quantized op function (checks, graph construction) and its primitive's fallback.
#include "quantized_batched_decode_attention.h"

#include <stdexcept>
#include <string>

#include "arguments.h"
#include "batched_decode_attention.h"
#include "decode_primitive.h"
#include "head_dims.h"
#include "mlx/ops.h"

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

// A head dim of keys or values: a multiple of group_size up to most.
void check_head_dim(const std::string& whose, int dim, int most, int group_size) {
  if (dim < 1 || dim > most || dim % group_size != 0) {
    fail(whose + " head dim " + std::to_string(dim) + " is not supported with group_size " +
         std::to_string(group_size) + "; multiples of group_size up to " + std::to_string(most) + " are.");
  }
}

DecodeShape check_quantized_arguments(const mx::array& queries, const std::vector<mx::array>& keys,
                                      const std::vector<mx::array>& values, const mx::array& valid_lens,
                                      int group_size, int bits, const DecodeOptions& options) {
  DecodeShape d = check_queries(kOp, queries);
  if (bits != 4 && bits != 8) {
    fail("bits must be 4 or 8, got " + std::to_string(bits) + ".");
  }
  if (group_size != 32 && group_size != 64 && group_size != 128) {
    fail("group_size must be 32, 64 or 128, got " + std::to_string(group_size) + ".");
  }
  if (keys.size() == 3 && keys[0].ndim() == 4) {
    d.H_kv = keys[0].shape(1);
    d.T = keys[0].shape(2);
  }
  // Values may be narrower than keys (MLA's latent): their words give their head dim.
  d.Dv = values.size() == 3 && values[0].ndim() == 4 ? values[0].shape(3) * 32 / bits : d.D;
  check_head_dim("the keys'", d.D, kMaxKeyHeadDim, group_size);
  check_head_dim("the values'", d.Dv, kMaxHeadDim, group_size);
  const mx::Shape rows = {d.B, d.H_kv, d.T};
  check_triple(keys, "keys", rows, d.D, group_size, bits);
  check_triple(values, "values", rows, d.Dv, group_size, bits);
  if (values[1].dtype() != keys[1].dtype()) {
    fail("the scales of keys and values must share one dtype, got " + dtype_str(keys[1].dtype()) + " and " +
         dtype_str(values[1].dtype()) + ".");
  }
  check_heads(kOp, d);
  reject_ring(kOp, options);
  check_options(kOp, d, valid_lens, options);
  return d;
}

// x as mx.dequantize gives it, in float32.
mx::array dequantized(const mx::array& packed, const mx::array& scales, const mx::array& biases, int group_size,
                      int bits, mx::StreamOrDevice s) {
  return mx::dequantize(packed, mx::astype(scales, mx::float32, s), mx::astype(biases, mx::float32, s), group_size,
                        bits, "affine", std::nullopt, std::nullopt, s);
}

} // namespace

mx::array quantized_batched_decode_attention(const mx::array& queries, const std::vector<mx::array>& keys,
                                             const std::vector<mx::array>& values, const mx::array& valid_lens,
                                             int group_size, int bits, const DecodeOptions& options,
                                             mx::StreamOrDevice s) {
  const int B = keys.size() == 3 && keys[0].ndim() == 4 ? keys[0].shape(0) : 0;
  const mx::array q = request_queries(kOp, queries, options, B, s);
  const DecodeShape d = check_quantized_arguments(q, keys, values, valid_lens, group_size, bits, options);
  return decode_output<QuantizedBatchedDecodeAttention>(decode_call(
      kOp, {q, keys[0], keys[1], keys[2], values[0], values[1], values[2]}, valid_lens, options, d.T, d.D, s,
      group_size, bits));
}

// The packed words [B, H_kv, T, W] as the rows.
RowArrays QuantizedBatchedDecodeAttention::rows(const std::vector<mx::array>& inputs) const {
  const mx::array& words = inputs[kKeyWords];
  return {words, inputs[kValueWords], words.shape(1), words.shape(2)};
}

mx::array QuantizedBatchedDecodeAttention::fallback(const std::vector<mx::array>& inputs) {
  const auto s = stream();
  const int group_size = attributes().group_size, bits = attributes().bits;
  const mx::array k = dequantized(inputs[kKeyWords], inputs[kKeyScales], inputs[kKeyBiases], group_size, bits, s);
  const mx::array v =
      dequantized(inputs[kValueWords], inputs[kValueScales], inputs[kValueBiases], group_size, bits, s);
  const mx::array q = call_queries(inputs);
  return mx::astype(
      reference_attention(mx::astype(q, mx::float32, s), k, v, valid_lens(inputs), options(inputs), s), q.dtype(), s);
}

} // namespace mlx_batched_decode
