// Padded, masked, batched decode attention as an MLX primitive.
//
// Dimension legend: B requests, H_q query heads, H_kv key/value heads
// (G = H_q / H_kv query heads share one KV head), L query rows per request,
// T padded cache length, D head dim.
#pragma once

#include <optional>

#include "head_dims.h"
#include "mlx/array.h"
#include "mlx/primitives.h"
#include "mlx/utils.h"

namespace mlx_batched_decode {

namespace mx = mlx::core;

// Attention of the last L tokens of each request over that request's keys.
//   queries    [B, H_q, L, D]    float16 | bfloat16 | float32
//   keys       [B, H_kv, T, D]   same dtype; any strides, read in place
//   values     [B, H_kv, T, D]   same dtype and shape as keys
//   valid_lens [B]               integer; len_b = clamp(valid_lens[b], 0, T)
//   kv_starts  [B]               optional integer; start_b = clamp(kv_starts[b], 0, T)
//   window     optional, >= 1: a row attends at most its last `window` keys
//   sinks      [H_q]             optional float: a per-head logit in every
//                                row's softmax denominator, not in the numerator
//   scale      defaults to 1/sqrt(D)
// Row i of request b sits at position p = len_b - L + i and attends keys
// max(start_b, p - window + 1, 0) .. p. Returns [B, H_q, L, D] in the queries'
// dtype; a row with no key gives zeros. Non-finite values in a row's range
// propagate as in a float32 softmax: a NaN score makes the row NaN, and a row
// whose scores are all -inf (with no finite sink) is 0/0 = NaN, on every
// backend. Malformed arguments throw std::invalid_argument (ValueError in Python).
mx::array batched_decode_attention(
    const mx::array& queries,
    const mx::array& keys,
    const mx::array& values,
    const mx::array& valid_lens,
    std::optional<float> scale = std::nullopt,
    const std::optional<mx::array>& kv_starts = std::nullopt,
    std::optional<int> window = std::nullopt,
    const std::optional<mx::array>& sinks = std::nullopt,
    mx::StreamOrDevice s = {});

// The same contract in plain MLX ops: the ground truth for tests and the
// primitive's fallback for vjp, jvp and vmap.
mx::array reference_attention(
    const mx::array& queries,
    const mx::array& keys,
    const mx::array& values,
    const mx::array& valid_lens,
    std::optional<float> scale = std::nullopt,
    const std::optional<mx::array>& kv_starts = std::nullopt,
    std::optional<int> window = std::nullopt,
    const std::optional<mx::array>& sinks = std::nullopt,
    mx::StreamOrDevice s = {});

// Inputs: queries, keys, values, valid_lens (int32 [B]), then kv_starts
// (int32 [B]) if has_kv_starts(), then sinks (float32 [H_q]) if has_sinks().
class BatchedDecodeAttention : public mx::UnaryPrimitive {
 public:
  BatchedDecodeAttention(mx::Stream stream, float scale, int window, bool has_kv_starts, bool has_sinks)
      : mx::UnaryPrimitive(stream),
        scale_(scale),
        window_(window),
        has_kv_starts_(has_kv_starts),
        has_sinks_(has_sinks) {}

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
  std::tuple<float, int, bool, bool> state() const {
    return {scale_, window_, has_kv_starts_, has_sinks_};
  }

  float scale() const {
    return scale_;
  }
  // The window in keys, 0 when the layer has none.
  int window() const {
    return window_;
  }
  bool has_kv_starts() const {
    return has_kv_starts_;
  }
  bool has_sinks() const {
    return has_sinks_;
  }

 private:
  // The fallback of the transformations: reference_attention with these options.
  std::vector<mx::array> fallback(const std::vector<mx::array>& inputs);

  float scale_;
  int window_;
  bool has_kv_starts_;
  bool has_sinks_;
};

// The window a kernel applies for T positions: `window` when it is set and
// shorter than T, else T (every window of T or more keys is no window).
inline int effective_window(int window, int T) {
  return window > 0 && window < T ? window : (T > 0 ? T : 1);
}

} // namespace mlx_batched_decode
