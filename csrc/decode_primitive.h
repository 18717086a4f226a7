// The primitives of the op family on one base, as MLX's own fast primitives
// share fast::Custom: the transformations (vjp, jvp, vmap) run through each
// op's fallback, its contract in plain MLX ops, written once here.
//
// Inputs of every primitive: the queries, the layout's row arrays (dense
// keys and values, paged pools and block tables, quantized triples), then
// valid_lens (int32 [B]), kv_starts (int32 [B]) if has_kv_starts, sinks
// (float32 [H_q]) if has_sinks, ring_offset (int32 [B], in [0, T)) if
// has_ring_offset and query_starts (int32 [B + 1]) if has_query_starts, the
// queries then being the view [B, H_q, N, D] of request_queries (arguments.h)
// and the output [N, H_q, D]. eval_cpu lives in cpu/, eval_gpu in metal/.
#pragma once

#include <array>
#include <functional>
#include <memory>
#include <vector>

#include "decode_options.h"
#include "mlx/primitives.h"
#include "mlx/utils.h"

namespace mlx_batched_decode {

// Where a call's key and value rows live, as both backends read them: arrays
// whose axes `axes` are the kernels' {request or page, head, position or row,
// dim}, holding H_kv heads over T logical positions; block_tables, if set,
// maps each request's positions to pages (the page axis then gives the pool's
// blocks and the row axis its block size). request_keys and request_values,
// if set, are B arrays each, one per request (the ragged layout, whose keys
// and values are the first request's and T the longest length): see
// request_axes and request_length.
struct RowArrays {
  const mx::array& keys;
  const mx::array& values;
  int H_kv, T;
  std::array<int, 4> axes = {0, 1, 2, 3};
  const mx::array* block_tables = nullptr;
  const mx::array* request_keys = nullptr;
  const mx::array* request_values = nullptr;
};

// The positions of one request's array of the ragged layout, [1, H_kv, T_b,
// D] or [H_kv, T_b, D], and its axes {head, position, dim}.
inline int request_length(const mx::array& a) {
  return a.shape(a.ndim() - 2);
}
inline std::array<int, 3> request_axes(const mx::array& a) {
  const int off = static_cast<int>(a.ndim()) - 3;
  return {off, off + 1, off + 2};
}

class DecodePrimitive : public mx::UnaryPrimitive {
 public:
  // row_inputs: how many inputs follow the queries before valid_lens.
  DecodePrimitive(mx::Stream stream, DecodeAttributes attributes, int row_inputs)
      : mx::UnaryPrimitive(stream), attributes_(attributes), lens_index_(1 + row_inputs) {}

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
  bool is_equivalent(const mx::Primitive& other) const override;
  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& inputs) override;

  const DecodeAttributes& attributes() const {
    return attributes_;
  }
  auto state() const {
    return attributes_.tie();
  }

  // The per-request and per-head inputs; kv_starts and sinks null when absent.
  const mx::array& valid_lens(const std::vector<mx::array>& inputs) const {
    return inputs[lens_index_];
  }
  const mx::array* kv_starts(const std::vector<mx::array>& inputs) const {
    return attributes_.has_kv_starts ? &inputs[lens_index_ + 1] : nullptr;
  }
  const mx::array* sinks(const std::vector<mx::array>& inputs) const {
    return attributes_.has_sinks ? &inputs[lens_index_ + 1 + attributes_.has_kv_starts] : nullptr;
  }
  const mx::array* ring_offset(const std::vector<mx::array>& inputs) const {
    return attributes_.has_ring_offset
        ? &inputs[lens_index_ + 1 + attributes_.has_kv_starts + attributes_.has_sinks]
        : nullptr;
  }
  const mx::array* query_starts(const std::vector<mx::array>& inputs) const {
    return attributes_.has_query_starts
        ? &inputs[lens_index_ + 1 + attributes_.has_kv_starts + attributes_.has_sinks + attributes_.has_ring_offset]
        : nullptr;
  }
  // The call's options as the references take them.
  DecodeOptions options(const std::vector<mx::array>& inputs) const;
  // The call's queries as the references take them: packed [N, H_q, D] with query_starts.
  mx::array call_queries(const std::vector<mx::array>& inputs);
  // The layout's key and value rows among the inputs.
  virtual RowArrays rows(const std::vector<mx::array>& inputs) const = 0;
  // The values' head dim Dv, the output's: the last axis of the value rows.
  virtual int value_dim(const std::vector<mx::array>& inputs) const {
    return rows(inputs).values.shape(-1);
  }

 protected:
  // The op's contract in plain MLX ops on the primitive's inputs.
  virtual mx::array fallback(const std::vector<mx::array>& inputs) = 0;

 private:
  // fallback as the transformations take a function.
  std::function<std::vector<mx::array>(const std::vector<mx::array>&)> fallback_fn() {
    return [this](const std::vector<mx::array>& in) { return std::vector<mx::array>{fallback(in)}; };
  }

  DecodeAttributes attributes_;
  int lens_index_;
};

// Inputs: queries, keys, values [B, H_kv, T, D], then the options.
class BatchedDecodeAttention : public DecodePrimitive {
 public:
  BatchedDecodeAttention(mx::Stream stream, DecodeAttributes attributes) : DecodePrimitive(stream, attributes, 2) {}
  void eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) override;
  void eval_gpu(const std::vector<mx::array>& inputs, mx::array& out) override;
  const char* name() const override {
    return "BatchedDecodeAttention";
  }
  RowArrays rows(const std::vector<mx::array>& inputs) const override;

 private:
  mx::array fallback(const std::vector<mx::array>& inputs) override;
};

// Inputs: queries, key_pages, value_pages [NB, BS, H_kv, D], block_tables
// (int32 [B, MB]), then the options (never kv_starts).
class PagedDecodeAttention : public DecodePrimitive {
 public:
  PagedDecodeAttention(mx::Stream stream, DecodeAttributes attributes) : DecodePrimitive(stream, attributes, 3) {}
  void eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) override;
  void eval_gpu(const std::vector<mx::array>& inputs, mx::array& out) override;
  const char* name() const override {
    return "PagedDecodeAttention";
  }
  RowArrays rows(const std::vector<mx::array>& inputs) const override;

 private:
  mx::array fallback(const std::vector<mx::array>& inputs) override;
};

// Inputs: queries, the key triple (packed, scales, biases), the value
// triple, then the options; attributes carry group_size and bits.
class QuantizedBatchedDecodeAttention : public DecodePrimitive {
 public:
  enum Input : int { kKeyWords = 1, kKeyScales, kKeyBiases, kValueWords, kValueScales, kValueBiases };

  QuantizedBatchedDecodeAttention(mx::Stream stream, DecodeAttributes attributes)
      : DecodePrimitive(stream, attributes, 6) {}
  void eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) override;
  void eval_gpu(const std::vector<mx::array>& inputs, mx::array& out) override;
  const char* name() const override {
    return "QuantizedBatchedDecodeAttention";
  }
  RowArrays rows(const std::vector<mx::array>& inputs) const override;
  // The packed words' D * bits / 32 as D.
  int value_dim(const std::vector<mx::array>& inputs) const override {
    return inputs[kValueWords].shape(-1) * 32 / attributes().bits;
  }

 private:
  mx::array fallback(const std::vector<mx::array>& inputs) override;
};

// Inputs: queries, the B requests' keys, then their B values (each
// [1, H_kv, T_b, D] or [H_kv, T_b, D]), then the options.
class RaggedDecodeAttention : public DecodePrimitive {
 public:
  RaggedDecodeAttention(mx::Stream stream, DecodeAttributes attributes, int B)
      : DecodePrimitive(stream, attributes, 2 * B) {}
  void eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) override;
  void eval_gpu(const std::vector<mx::array>& inputs, mx::array& out) override;
  const char* name() const override {
    return "RaggedDecodeAttention";
  }
  RowArrays rows(const std::vector<mx::array>& inputs) const override;

 private:
  mx::array fallback(const std::vector<mx::array>& inputs) override;
};

// A call of op `op` (the prefix of its errors) as a primitive's inputs and
// attributes: rows are the queries and the layout's row arrays; valid_lens
// and kv_starts go in as int32 (the kernels clamp them to [0, T]), sinks as
// float32, ring_offset as int32 [B] taken modulo T. A GPU stream in a build without Metal is an invalid_argument.
struct DecodeCall {
  mx::Stream stream;
  DecodeAttributes attributes;
  std::vector<mx::array> inputs;
};
DecodeCall decode_call(const char* op, std::vector<mx::array> rows, const mx::array& valid_lens,
                       const DecodeOptions& options, int T, int D, mx::StreamOrDevice s, int group_size = 0,
                       int bits = 0);

// The output of a call of primitive P, built with the further constructor
// arguments `extra`, in the queries' dtype: [B, H_q, L, Dv], or [N, H_q, Dv]
// with query_starts.
template <typename P, typename... Extra>
mx::array decode_output(DecodeCall call, Extra... extra) {
  auto primitive = std::make_shared<P>(call.stream, call.attributes, extra...);
  // Taken first: the inputs move into the array.
  mx::Shape shape = primitive->output_shapes(call.inputs)[0];
  const mx::Dtype dtype = call.inputs[0].dtype();
  return mx::array(std::move(shape), dtype, std::move(primitive), std::move(call.inputs));
}

} // namespace mlx_batched_decode
