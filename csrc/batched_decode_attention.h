// Padded, masked, batched decode attention as an MLX primitive.
//
// Dimension legend: B requests, H_q query heads, H_kv key/value heads
// (G = H_q / H_kv query heads share one KV head), T padded cache length,
// D head dim.
#pragma once

#include <optional>

#include "mlx/array.h"
#include "mlx/primitives.h"
#include "mlx/utils.h"

namespace mlx_batched_decode {

namespace mx = mlx::core;

// Head dims with a compiled kernel (CPU and Metal).
inline constexpr int kHeadDims[] = {64, 80, 96, 128, 256};

// Attention of one new token per request over that request's valid keys.
//   queries    [B, H_q, 1, D]    float16 | bfloat16 | float32
//   keys       [B, H_kv, T, D]   same dtype; any strides, read in place
//   values     [B, H_kv, T, D]   same dtype and shape as keys
//   valid_lens [B]               integer; positions 0 .. valid_lens[b]-1 attend,
//                                the rest is ignored; clamped to [0, T]
//   scale      defaults to 1/sqrt(D)
// Returns [B, H_q, 1, D] in the queries' dtype; an empty request gives zeros.
// Malformed arguments throw std::invalid_argument (ValueError in Python).
mx::array batched_decode_attention(
    const mx::array& queries,
    const mx::array& keys,
    const mx::array& values,
    const mx::array& valid_lens,
    std::optional<float> scale = std::nullopt,
    mx::StreamOrDevice s = {});

// The same contract in plain MLX ops: the ground truth for tests and the
// primitive's fallback for vjp, jvp and vmap.
mx::array reference_attention(
    const mx::array& queries,
    const mx::array& keys,
    const mx::array& values,
    const mx::array& valid_lens,
    std::optional<float> scale = std::nullopt,
    mx::StreamOrDevice s = {});

class BatchedDecodeAttention : public mx::UnaryPrimitive {
 public:
  BatchedDecodeAttention(mx::Stream stream, float scale)
      : mx::UnaryPrimitive(stream), scale_(scale) {}

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
    return "BatchedDecodeAttention";
  }
  bool is_equivalent(const mx::Primitive& other) const override;
  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& inputs) override;
  float state() const {
    return scale_;
  }

 private:
  // The fallback of the transformations: reference_attention with this scale.
  std::vector<mx::array> fallback(const std::vector<mx::array>& inputs);

  float scale_;
};

} // namespace mlx_batched_decode
