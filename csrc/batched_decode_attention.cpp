// The dense op function (checks, graph construction) and its primitive's fallback.
#include "batched_decode_attention.h"

#include "arguments.h"
#include "decode_primitive.h"

namespace mlx_batched_decode {

mx::array batched_decode_attention(const mx::array& queries, const mx::array& keys, const mx::array& values,
                                   const mx::array& valid_lens, const DecodeOptions& options, mx::StreamOrDevice s) {
  const mx::array q =
      request_queries("batched_decode_attention", queries, options, keys.ndim() == 4 ? keys.shape(0) : 0, s);
  const DecodeShape d = check_arguments(q, keys, values, valid_lens, options);
  return decode_output<BatchedDecodeAttention>(
      decode_call("batched_decode_attention", {q, keys, values}, valid_lens, options, d.T, d.D, s));
}

RowArrays BatchedDecodeAttention::rows(const std::vector<mx::array>& inputs) const {
  const mx::array& keys = inputs[1];
  return {keys, inputs[2], keys.shape(1), keys.shape(2)};
}

mx::array BatchedDecodeAttention::fallback(const std::vector<mx::array>& inputs) {
  return reference_attention(call_queries(inputs), inputs[1], inputs[2], valid_lens(inputs), options(inputs), stream());
}

} // namespace mlx_batched_decode
