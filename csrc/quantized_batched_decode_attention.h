// Batched decode attention over quantized keys and values (mx.quantize's
// affine format) as an MLX primitive.
//
// Dimension legend: B requests, H_q query heads, H_kv key/value heads
// (G = H_q / H_kv), L query rows per request, T padded cache length, D head
// dim, W = D * bits / 32 packed words per row, S = D / group_size groups per row.
#pragma once

#include <optional>
#include <tuple>
#include <vector>

#include "mlx/array.h"
#include "mlx/primitives.h"
#include "mlx/utils.h"

namespace mlx_batched_decode {

namespace mx = mlx::core;

// batched_decode_attention on keys and values stored as the triples
// (packed, scales, biases) that mx.quantize(x, group_size, bits) returns:
//   queries    [B, H_q, L, D]    float16 | bfloat16 | float32
//   keys       (packed uint32 [B, H_kv, T, W], scales [B, H_kv, T, S],
//               biases [B, H_kv, T, S]); scales and biases float16, bfloat16
//               or float32, any strides (views are read in place)
//   values     the same layout, shapes and scale dtype as keys
//   group_size 32, 64 or 128, dividing D; bits 4 or 8
// The rest as batched_decode_attention. Element e of a row is
// scales[e / group_size] * q_e + biases[e / group_size], q_e the bits-wide
// unsigned integer at bit (e % (32 / bits)) * bits of word e / (32 / bits).
// Returns [B, H_q, L, D] in the queries' dtype, accumulated in float32.
mx::array quantized_batched_decode_attention(
    const mx::array& queries,
    const std::vector<mx::array>& keys,
    const std::vector<mx::array>& values,
    const mx::array& valid_lens,
    int group_size = 64,
    int bits = 8,
    std::optional<float> scale = std::nullopt,
    const std::optional<mx::array>& kv_starts = std::nullopt,
    std::optional<int> window = std::nullopt,
    const std::optional<mx::array>& sinks = std::nullopt,
    mx::StreamOrDevice s = {});

// Input indices of the primitive: queries, then the key and value triples,
// valid_lens (int32 [B]), kv_starts (int32 [B]) if has_kv_starts(), sinks
// (float32 [H_q]) if has_sinks().
enum QuantizedInput : int {
  kQuantQueries = 0,
  kKeyWords = 1,
  kKeyScales = 2,
  kKeyBiases = 3,
  kValueWords = 4,
  kValueScales = 5,
  kValueBiases = 6,
  kQuantValidLens = 7,
  kQuantOptions = 8,
};

class QuantizedBatchedDecodeAttention : public mx::UnaryPrimitive {
 public:
  QuantizedBatchedDecodeAttention(
      mx::Stream stream, float scale, int window, bool has_kv_starts, bool has_sinks, int group_size, int bits)
      : mx::UnaryPrimitive(stream),
        scale_(scale),
        window_(window),
        has_kv_starts_(has_kv_starts),
        has_sinks_(has_sinks),
        group_size_(group_size),
        bits_(bits) {}

  void eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) override;
  void eval_gpu(const std::vector<mx::array>& inputs, mx::array& out) override;

  std::vector<mx::array> vjp(
      const std::vector<mx::array>& primals,
      const std::vector<mx::array>& cotangents,
      const std::vector<int>& argnums,
      const std::vector<mx::array>& outputs) override;
  std::vector<mx::array> jvp(
      const std::vector<mx::array>& primals,
      const std::vector<mx::array>& tangents,
      const std::vector<int>& argnums) override;
  std::pair<std::vector<mx::array>, std::vector<int>> vmap(
      const std::vector<mx::array>& inputs,
      const std::vector<int>& axes) override;

  const char* name() const override {
    return "QuantizedBatchedDecodeAttention";
  }
  bool is_equivalent(const mx::Primitive& other) const override;
  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& inputs) override;
  std::tuple<float, int, bool, bool, int, int> state() const {
    return {scale_, window_, has_kv_starts_, has_sinks_, group_size_, bits_};
  }

 private:
  // The fallback of the transformations: dequantize, then reference_attention.
  std::vector<mx::array> fallback(const std::vector<mx::array>& inputs);

  float scale_;
  int window_; // 0: none
  bool has_kv_starts_;
  bool has_sinks_;
  int group_size_;
  int bits_;
};

} // namespace mlx_batched_decode
