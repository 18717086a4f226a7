// The op function (checks, graph construction) and the primitive's
// device-independent methods. eval_cpu lives in cpu/, eval_gpu in metal/.
#include "batched_decode_attention.h"

#include <stdexcept>

#include "arguments.h"
#include "mlx/ops.h"
#include "mlx/transforms.h"

namespace mlx_batched_decode {

mx::array batched_decode_attention(
    const mx::array& queries,
    const mx::array& keys,
    const mx::array& values,
    const mx::array& valid_lens,
    std::optional<float> scale,
    mx::StreamOrDevice s) {
  const DecodeShape d = check_arguments(queries, keys, values, valid_lens, scale);
  auto stream = mx::to_stream(s);
#if !defined(MLX_BATCHED_DECODE_METAL)
  if (stream.device == mx::Device::gpu) {
    throw std::invalid_argument(
        "[batched_decode_attention] this build has no Metal kernel; run it on a CPU stream.");
  }
#endif
  // The kernel reads int32 lengths and clamps them to [0, T] itself.
  auto lens = lengths_as_int32(valid_lens, d.T, stream);
  return mx::array(
      {d.B, d.H_q, 1, d.D},
      queries.dtype(),
      std::make_shared<BatchedDecodeAttention>(stream, resolve_scale(scale, d.D)),
      {queries, keys, values, lens});
}

std::vector<mx::array> BatchedDecodeAttention::fallback(
    const std::vector<mx::array>& inputs) {
  return {reference_attention(inputs[0], inputs[1], inputs[2], inputs[3], scale_, stream())};
}

std::vector<mx::array> BatchedDecodeAttention::vjp(
    const std::vector<mx::array>& primals,
    const std::vector<mx::array>& cotangents,
    const std::vector<int>& argnums,
    const std::vector<mx::array>&) {
  auto f = [this](const std::vector<mx::array>& in) { return fallback(in); };
  auto [_, grads] = mx::vjp(f, primals, cotangents);
  std::vector<mx::array> out;
  for (int i : argnums) {
    out.push_back(grads[i]);
  }
  return out;
}

std::vector<mx::array> BatchedDecodeAttention::jvp(
    const std::vector<mx::array>& primals,
    const std::vector<mx::array>& tangents,
    const std::vector<int>& argnums) {
  std::vector<mx::array> all_tangents;
  for (int i = 0, j = 0; i < static_cast<int>(primals.size()); ++i) {
    bool given = j < static_cast<int>(argnums.size()) && argnums[j] == i;
    all_tangents.push_back(given ? tangents[j++] : mx::zeros_like(primals[i]));
  }
  auto f = [this](const std::vector<mx::array>& in) { return fallback(in); };
  return mx::jvp(f, primals, all_tangents).second;
}

std::pair<std::vector<mx::array>, std::vector<int>> BatchedDecodeAttention::vmap(
    const std::vector<mx::array>& inputs,
    const std::vector<int>& axes) {
  auto f = [this](const std::vector<mx::array>& in) { return fallback(in); };
  return {mx::vmap(f, axes)(inputs), {0}};
}

bool BatchedDecodeAttention::is_equivalent(const mx::Primitive& other) const {
  const auto& o = static_cast<const BatchedDecodeAttention&>(other);
  return scale_ == o.scale_;
}

std::vector<mx::Shape> BatchedDecodeAttention::output_shapes(
    const std::vector<mx::array>& inputs) {
  return {inputs[0].shape()};
}

#if !defined(MLX_BATCHED_DECODE_METAL)
void BatchedDecodeAttention::eval_gpu(const std::vector<mx::array>&, mx::array&) {
  // Unreachable through the op function, which rejects GPU streams in this build.
  throw std::runtime_error("[batched_decode_attention] this build has no Metal kernel.");
}
#endif

} // namespace mlx_batched_decode
