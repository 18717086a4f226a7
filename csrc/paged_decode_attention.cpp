// The paged op function (checks, graph construction) and the primitive's
// device-independent methods. eval_cpu lives in cpu/, eval_gpu in metal/.
#include "paged_decode_attention.h"

#include <stdexcept>

#include "arguments.h"
#include "mlx/ops.h"
#include "mlx/transforms.h"
#include "paged_arguments.h"

namespace mlx_batched_decode {

mx::array paged_decode_attention(
    const mx::array& queries,
    const mx::array& key_pages,
    const mx::array& value_pages,
    const mx::array& block_tables,
    const mx::array& valid_lens,
    std::optional<float> scale,
    std::optional<int> window,
    const std::optional<mx::array>& sinks,
    mx::StreamOrDevice s) {
  const PagedShape d = check_paged_arguments(queries, key_pages, value_pages, block_tables, valid_lens, scale, window, sinks);
  auto stream = mx::to_stream(s);
#if !defined(MLX_BATCHED_DECODE_METAL)
  if (stream.device == mx::Device::gpu) {
    throw std::invalid_argument(
        "[paged_decode_attention] this build has no Metal kernel; run it on a CPU stream.");
  }
#endif
  // The kernels read int32 lengths and float32 sinks, and clamp lengths to [0, T] themselves.
  std::vector<mx::array> inputs = {
      queries, key_pages, value_pages, block_tables, positions_as_int32(valid_lens, d.T, stream)};
  if (sinks) {
    inputs.push_back(mx::astype(*sinks, mx::float32, stream));
  }
  return mx::array(
      queries.shape(),
      queries.dtype(),
      std::make_shared<PagedDecodeAttention>(stream, resolve_scale(scale, d.D), window.value_or(0), sinks.has_value()),
      std::move(inputs));
}

std::vector<mx::array> PagedDecodeAttention::fallback(const std::vector<mx::array>& inputs) {
  return {reference_paged_attention(
      inputs[0], inputs[1], inputs[2], inputs[3], inputs[4], scale_,
      window_ > 0 ? std::optional<int>(window_) : std::nullopt,
      has_sinks_ ? std::optional<mx::array>(inputs[5]) : std::nullopt, stream())};
}

std::vector<mx::array> PagedDecodeAttention::vjp(
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

std::vector<mx::array> PagedDecodeAttention::jvp(
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

std::pair<std::vector<mx::array>, std::vector<int>> PagedDecodeAttention::vmap(
    const std::vector<mx::array>& inputs,
    const std::vector<int>& axes) {
  auto f = [this](const std::vector<mx::array>& in) { return fallback(in); };
  return {mx::vmap(f, axes)(inputs), {0}};
}

bool PagedDecodeAttention::is_equivalent(const mx::Primitive& other) const {
  const auto& o = static_cast<const PagedDecodeAttention&>(other);
  return state() == o.state();
}

std::vector<mx::Shape> PagedDecodeAttention::output_shapes(const std::vector<mx::array>& inputs) {
  return {inputs[0].shape()};
}

#if !defined(MLX_BATCHED_DECODE_METAL)
void PagedDecodeAttention::eval_gpu(const std::vector<mx::array>&, mx::array&) {
  // Unreachable through the op function, which rejects GPU streams in this build.
  throw std::runtime_error("[paged_decode_attention] this build has no Metal kernel.");
}
#endif

} // namespace mlx_batched_decode
