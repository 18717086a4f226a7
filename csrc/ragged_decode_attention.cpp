// The ragged op function (checks, graph construction) and its primitive's fallback.
#include "ragged_decode_attention.h"

#include <algorithm>

#include "decode_primitive.h"
#include "mlx/ops.h"
#include "ragged_arguments.h"

namespace mlx_batched_decode {

mx::array ragged_decode_attention(const mx::array& queries, const std::vector<mx::array>& keys,
                                  const std::vector<mx::array>& values, const std::optional<mx::array>& valid_lens,
                                  const DecodeOptions& options, mx::StreamOrDevice s) {
  const mx::array q = request_queries("ragged_decode_attention", queries, options, keys.size(), s);
  const RaggedShape r = check_ragged_arguments(q, keys, values, valid_lens, options);
  if (r.d.B == 0) {
    return mx::zeros(queries.shape(), queries.dtype(), s);
  }
  std::vector<mx::array> rows{q};
  rows.insert(rows.end(), keys.begin(), keys.end());
  rows.insert(rows.end(), values.begin(), values.end());
  return decode_output<RaggedDecodeAttention>(
      decode_call("ragged_decode_attention", std::move(rows), ragged_lengths(valid_lens, r), options, r.d.T, r.d.D, s),
      r.d.B);
}

RowArrays RaggedDecodeAttention::rows(const std::vector<mx::array>& inputs) const {
  const int B = inputs[0].shape(0);
  const mx::array& first = inputs[1];
  int T = 0;
  for (int b = 0; b < B; ++b) {
    T = std::max(T, request_length(inputs[1 + b]));
  }
  RowArrays rows{first, inputs[1 + B], first.shape(first.ndim() - 3), T};
  rows.request_keys = &inputs[1];
  rows.request_values = &inputs[1 + B];
  return rows;
}

mx::array RaggedDecodeAttention::fallback(const std::vector<mx::array>& inputs) {
  const int B = inputs[0].shape(0);
  const std::vector<mx::array> keys(inputs.begin() + 1, inputs.begin() + 1 + B);
  const std::vector<mx::array> values(inputs.begin() + 1 + B, inputs.begin() + 1 + 2 * B);
  return reference_ragged_attention(call_queries(inputs), keys, values, valid_lens(inputs), options(inputs), stream());
}

} // namespace mlx_batched_decode
