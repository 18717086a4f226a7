// reference_attention: the contract of batched_decode_attention in plain MLX
// ops, in float32. Used as ground truth and as the primitive's fallback.
#include <algorithm>
#include <limits>
#include <tuple>

#include "arguments.h"
#include "batched_decode_attention.h"
#include "reference_attention.h"
#include "mlx/ops.h"

namespace mlx_batched_decode {

namespace {

// Per-request positions as int32 [B] clamped to [0, T].
mx::array clamped_positions(const mx::array& positions, int T, mx::StreamOrDevice s) {
  return mx::clip(positions_as_int32(positions, T, s), mx::array(0), mx::array(T), s);
}

} // namespace

mx::array reference_attention(const mx::array& packed, const mx::array& keys, const mx::array& values,
                              const mx::array& valid_lens, const DecodeOptions& options, mx::StreamOrDevice s) {
  const mx::array queries =
      request_queries("batched_decode_attention", packed, options, keys.ndim() == 4 ? keys.shape(0) : 0, s);
  const DecodeShape d = check_arguments(queries, keys, values, valid_lens, options);
  if (!options.ring_offset) {
    return masked_reference_attention(queries, keys, values, valid_lens, options, std::nullopt, s);
  }
  // A ring's positions in time order: logical position j of request b is slot (j + offset_b) mod T.
  auto offsets = mx::reshape(ring_offsets_as_int32(*options.ring_offset, d.B, d.T, s), {d.B, 1, 1, 1}, s);
  auto slots = mx::remainder(mx::add(mx::reshape(mx::arange(d.T, mx::int32, s), {1, 1, d.T, 1}, s), offsets, s),
                             mx::array(std::max(d.T, 1)), s);
  slots = mx::stop_gradient(mx::broadcast_to(slots, {d.B, d.H_kv, d.T, 1}, s), s);
  DecodeOptions logical = options;
  logical.ring_offset.reset();
  return masked_reference_attention(queries, mx::take_along_axis(keys, slots, 2, s),
                                    mx::take_along_axis(values, slots, 2, s), valid_lens, logical, std::nullopt, s);
}

mx::array masked_reference_attention(const mx::array& queries, const mx::array& keys, const mx::array& values,
                                     const mx::array& valid_lens, const DecodeOptions& options,
                                     const std::optional<mx::array>& key_mask, mx::StreamOrDevice s) {
  // Positions are logical here: the ring, if any, was undone by the caller.
  const auto& [scale, kv_starts, window, sinks] =
      std::tie(options.scale, options.kv_starts, options.window, options.sinks);
  const DecodeShape d{queries.shape(0), queries.shape(1), keys.shape(1), queries.shape(1) / keys.shape(1),
                      queries.shape(2), keys.shape(2),    queries.shape(3)};
  const float sc = resolve_scale(scale, d.D);
  const int Dv = values.shape(3);

  // [B, H_kv, G, L, D]: the G query heads of a KV head attend to the same keys.
  auto q = mx::reshape(mx::multiply(mx::astype(queries, mx::float32, s), mx::array(sc), s),
                       {d.B, d.H_kv, d.G, d.L, d.D}, s);
  auto k = mx::reshape(mx::astype(keys, mx::float32, s), {d.B, d.H_kv, 1, d.T, d.D}, s);
  auto v = mx::reshape(mx::astype(values, mx::float32, s), {d.B, d.H_kv, 1, 1, d.T, Dv}, s);

  // Row i of request b sits at p = len_b - L + i and attends keys lo .. p.
  auto len = mx::reshape(clamped_positions(valid_lens, d.T, s), {d.B, 1}, s);
  auto p = mx::add(mx::subtract(len, mx::array(d.L), s), mx::arange(d.L, mx::int32, s), s); // [B, L]
  if (options.query_starts) {
    // Packed rows (L = N): row n of request b's rows [first, end) sits at
    // len_b - (end - first) + n - first; the rows of other requests at -1, before every key.
    auto qs = mx::stop_gradient(mx::astype(*options.query_starts, mx::int32, s), s);
    auto first = mx::reshape(mx::slice(qs, {0}, {d.B}, s), {d.B, 1}, s);
    auto end = mx::reshape(mx::slice(qs, {1}, {d.B + 1}, s), {d.B, 1}, s);
    auto n = mx::reshape(mx::arange(d.L, mx::int32, s), {1, d.L}, s);
    auto mine = mx::logical_and(mx::greater_equal(n, first, s), mx::less(n, end, s), s);
    auto row = mx::add(mx::subtract(len, mx::subtract(end, first, s), s), mx::subtract(n, first, s), s);
    p = mx::where(mine, row, mx::array(-1), s);
  }
  auto lo = kv_starts ? mx::reshape(clamped_positions(*kv_starts, d.T, s), {d.B, 1}, s)
                      : mx::zeros({d.B, 1}, mx::int32, s);
  if (window) {
    const int w = effective_window(*window, d.T);
    lo = mx::maximum(lo, mx::add(p, mx::array(1 - w), s), s);
  }
  auto j = mx::reshape(mx::arange(d.T, mx::int32, s), {1, 1, d.T}, s);
  auto attends = mx::logical_and(
      mx::greater_equal(j, mx::expand_dims(lo, 2, s), s),
      mx::less_equal(j, mx::expand_dims(p, 2, s), s), s); // [B, L, T]
  if (key_mask) {
    attends = mx::logical_and(attends, mx::expand_dims(*key_mask, 1, s), s);
  }
  auto mask = mx::reshape(attends, {d.B, 1, 1, d.L, d.T}, s);

  auto scores = mx::matmul(q, mx::swapaxes(k, 3, 4, s), s); // [B, H_kv, G, L, T]
  if (options.softcap) {
    const float c = *options.softcap;
    scores = mx::multiply(mx::tanh(mx::multiply(scores, mx::array(1.0f / c), s), s), mx::array(c), s);
  }
  scores = mx::where(mask, scores, mx::array(-std::numeric_limits<float>::infinity()), s);
  // A row without keys would have only -inf scores and NaN probabilities (and
  // gradients): give it finite scores, then zero all its probabilities below.
  scores = mx::where(mx::any(mask, -1, /* keepdims */ true, s), scores, mx::array(0.0f), s);
  mx::array probs = scores;
  if (sinks) {
    // The sink is one more logit in each row's softmax, with no value.
    auto sink = mx::broadcast_to(mx::reshape(mx::astype(*sinks, mx::float32, s), {1, d.H_kv, d.G, 1, 1}, s),
                                 {d.B, d.H_kv, d.G, d.L, 1}, s);
    probs = mx::softmax(mx::concatenate({scores, sink}, 4, s), -1, /* precise */ true, s);
    probs = mx::slice(probs, {0, 0, 0, 0, 0}, {d.B, d.H_kv, d.G, d.L, d.T}, s);
  } else {
    probs = mx::softmax(scores, -1, /* precise */ true, s);
  }
  probs = mx::where(mask, probs, mx::array(0.0f), s);
  // A key outside a row's range may hold NaN or inf, and 0 * NaN is NaN: zero
  // the values per row ([B, H_kv, 1, L, T, D]) before the product.
  v = mx::where(mx::reshape(attends, {d.B, 1, 1, d.L, d.T, 1}, s), v, mx::array(0.0f), s);

  auto out = mx::reshape(mx::matmul(mx::reshape(probs, {d.B, d.H_kv, d.G, d.L, 1, d.T}, s), v, s),
                         {d.B, d.H_q, d.L, Dv}, s);
  if (options.query_starts) {
    // Each packed row is zero in every request's entry but its own.
    out = mx::transpose(mx::sum(out, 0, false, s), {1, 0, 2}, s);
  }
  return mx::astype(out, queries.dtype(), s);
}

} // namespace mlx_batched_decode
