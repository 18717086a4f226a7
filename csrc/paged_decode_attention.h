// Decode attention over paged key/value caches (block tables) as an MLX
// primitive: batched_decode_attention's semantics on pools of fixed-size
// blocks, the layout of vLLM and SGLang.
//
// Dimension legend: B requests, H_q query heads, H_kv key/value heads
// (G = H_q / H_kv), L query rows per request, D head dim, NB blocks in the
// pool, BS rows per block (block_size), MB table entries per request
// (max_blocks), T = MB * BS logical positions.
#pragma once

#include <optional>
#include <tuple>

#include "mlx/array.h"
#include "mlx/primitives.h"
#include "mlx/utils.h"

namespace mlx_batched_decode {

namespace mx = mlx::core;

// Attention of the last L tokens of each request over its paged keys.
//   queries      [B, H_q, L, D]      float16 | bfloat16 | float32
//   key_pages    [NB, BS, H_kv, D]   same dtype; any strides, read in place
//   value_pages  [NB, BS, H_kv, D]   same dtype and shape
//   block_tables [B, MB]             int32: position j of request b is row
//                                    j % BS of block block_tables[b, j / BS]
//   valid_lens   [B]                 integer; len_b = clamp(valid_lens[b], 0, T)
//   window, sinks, scale             as batched_decode_attention
// Table entries at or past len_b are never read; an entry inside len_b that
// lies outside [0, NB) is never dereferenced and its block holds no key.
// Returns [B, H_q, L, D] in the queries' dtype; a row with no key gives zeros.
// Malformed arguments throw std::invalid_argument (ValueError in Python).
mx::array paged_decode_attention(
    const mx::array& queries,
    const mx::array& key_pages,
    const mx::array& value_pages,
    const mx::array& block_tables,
    const mx::array& valid_lens,
    std::optional<float> scale = std::nullopt,
    std::optional<int> window = std::nullopt,
    const std::optional<mx::array>& sinks = std::nullopt,
    mx::StreamOrDevice s = {});

// The same contract in plain MLX ops (gather the pages, mask, float32
// softmax): ground truth for tests and the primitive's fallback.
mx::array reference_paged_attention(
    const mx::array& queries,
    const mx::array& key_pages,
    const mx::array& value_pages,
    const mx::array& block_tables,
    const mx::array& valid_lens,
    std::optional<float> scale = std::nullopt,
    std::optional<int> window = std::nullopt,
    const std::optional<mx::array>& sinks = std::nullopt,
    mx::StreamOrDevice s = {});

// Inputs: queries, key_pages, value_pages, block_tables (int32 [B, MB]),
// valid_lens (int32 [B]), then sinks (float32 [H_q]) if has_sinks().
class PagedDecodeAttention : public mx::UnaryPrimitive {
 public:
  PagedDecodeAttention(mx::Stream stream, float scale, int window, bool has_sinks)
      : mx::UnaryPrimitive(stream), scale_(scale), window_(window), has_sinks_(has_sinks) {}

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
    return "PagedDecodeAttention";
  }
  bool is_equivalent(const mx::Primitive& other) const override;
  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& inputs) override;
  std::tuple<float, int, bool> state() const {
    return {scale_, window_, has_sinks_};
  }

  float scale() const {
    return scale_;
  }
  // The window in keys, 0 when the layer has none.
  int window() const {
    return window_;
  }
  bool has_sinks() const {
    return has_sinks_;
  }

 private:
  // The fallback of the transformations: reference_paged_attention with these options.
  std::vector<mx::array> fallback(const std::vector<mx::array>& inputs);

  float scale_;
  int window_;
  bool has_sinks_;
};

} // namespace mlx_batched_decode
