// reference_ragged_attention: the ragged op's contract in plain MLX ops, as
// the reference of each request on its own arrays, joined on the batch axis
// (added up, for packed queries: each row is zero in the others' results).
#include "arguments.h"
#include "batched_decode_attention.h"
#include "mlx/ops.h"
#include "ragged_arguments.h"
#include "ragged_decode_attention.h"
#include "reference_attention.h"

namespace mlx_batched_decode {

mx::array reference_ragged_attention(const mx::array& packed, const std::vector<mx::array>& keys,
                                     const std::vector<mx::array>& values, const std::optional<mx::array>& valid_lens,
                                     const DecodeOptions& options, mx::StreamOrDevice s) {
  const mx::array queries = request_queries("ragged_decode_attention", packed, options, keys.size(), s);
  const RaggedShape r = check_ragged_arguments(queries, keys, values, valid_lens, options);
  const DecodeShape& d = r.d;
  if (d.B == 0) {
    return mx::zeros(packed.shape(), packed.dtype(), s);
  }
  const mx::array lens = ragged_lengths(valid_lens, r);
  // Request b's slice [b, b + 1) of a per-request array.
  auto one = [&](const mx::array& a, int b) { return mx::slice(a, {b}, {b + 1}, s); };
  auto as_batch = [&](const mx::array& a) { return a.ndim() == 4 ? a : mx::expand_dims(a, 0, s); };
  std::vector<mx::array> outs;
  for (int b = 0; b < d.B; ++b) {
    DecodeOptions o = options;
    if (options.kv_starts) {
      o.kv_starts = one(*options.kv_starts, b);
    }
    // Packed rows: request b's bounds [first, end) of all N rows; the others come out zero.
    if (options.query_starts) {
      o.query_starts = mx::slice(*options.query_starts, {b}, {b + 2}, s);
    }
    outs.push_back(masked_reference_attention(mx::slice(queries, {b, 0, 0, 0}, {b + 1, d.H_q, d.L, d.D}, s),
                                              as_batch(keys[b]), as_batch(values[b]), one(lens, b), o, std::nullopt,
                                              s));
  }
  return options.query_starts ? mx::sum(mx::stack(outs, 0, s), 0, false, s) : mx::concatenate(outs, 0, s);
}

} // namespace mlx_batched_decode
