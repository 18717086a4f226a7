// reference_attention: the contract of batched_decode_attention in plain MLX
// ops, in float32. Used as ground truth and as the primitive's fallback.
#include <limits>

#include "arguments.h"
#include "batched_decode_attention.h"
#include "mlx/ops.h"

namespace mlx_batched_decode {

mx::array reference_attention(
    const mx::array& queries,
    const mx::array& keys,
    const mx::array& values,
    const mx::array& valid_lens,
    std::optional<float> scale,
    mx::StreamOrDevice s) {
  const DecodeShape d = check_arguments(queries, keys, values, valid_lens, scale);
  const float sc = resolve_scale(scale, d.D);

  // [B, H_kv, G, D]: the G query heads of a KV head attend to the same keys.
  auto q = mx::reshape(
      mx::multiply(mx::astype(queries, mx::float32, s), mx::array(sc), s),
      {d.B, d.H_kv, d.G, d.D}, s);
  auto k = mx::astype(keys, mx::float32, s);
  auto v = mx::astype(values, mx::float32, s);

  auto lens = mx::clip(lengths_as_int32(valid_lens, d.T, s), mx::array(0), mx::array(d.T), s);
  // valid [B, 1, T, 1]: true for positions a request attends to.
  auto valid = mx::less(
      mx::reshape(mx::arange(d.T, mx::int32, s), {1, 1, d.T, 1}, s),
      mx::reshape(lens, {d.B, 1, 1, 1}, s), s);
  auto valid_row = mx::swapaxes(valid, 2, 3, s); // [B, 1, 1, T]

  auto scores = mx::matmul(q, mx::swapaxes(k, 2, 3, s), s); // [B, H_kv, G, T]
  auto neg_inf = mx::array(-std::numeric_limits<float>::infinity());
  scores = mx::where(valid_row, scores, neg_inf, s);
  // An empty request would have only -inf scores and NaN probabilities (and
  // gradients): give it finite scores, then zero all its probabilities below.
  auto nonempty = mx::reshape(mx::greater(lens, mx::array(0), s), {d.B, 1, 1, 1}, s);
  scores = mx::where(nonempty, scores, mx::array(0.0f), s);
  auto probs = mx::softmax(scores, -1, /* precise */ true, s);
  probs = mx::where(valid_row, probs, mx::array(0.0f), s);
  // Padding may hold NaN or inf, and 0 * NaN is NaN: zero it before the product.
  v = mx::where(valid, v, mx::array(0.0f), s);

  auto out = mx::matmul(probs, v, s); // [B, H_kv, G, D]
  return mx::astype(mx::reshape(out, {d.B, d.H_q, 1, d.D}, s), queries.dtype(), s);
}

} // namespace mlx_batched_decode
