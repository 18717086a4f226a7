// The paged op function (checks, graph construction) and its primitive's fallback.
#include "paged_decode_attention.h"

#include "decode_primitive.h"
#include "paged_arguments.h"

namespace mlx_batched_decode {

mx::array paged_decode_attention(const mx::array& queries, const mx::array& key_pages, const mx::array& value_pages,
                                 const mx::array& block_tables, const mx::array& valid_lens,
                                 const DecodeOptions& options, mx::StreamOrDevice s) {
  const mx::array q = request_queries(
      "paged_decode_attention", queries, options, block_tables.ndim() == 2 ? block_tables.shape(0) : 0, s);
  const PagedShape p = check_paged_arguments(q, key_pages, value_pages, block_tables, valid_lens, options);
  return decode_output<PagedDecodeAttention>(decode_call(
      "paged_decode_attention", {q, key_pages, value_pages, block_tables}, valid_lens, options, p.d.T, p.d.D, s));
}

// Pools [page, row, head, dim] as the kernels' {page, head, row, dim}.
RowArrays PagedDecodeAttention::rows(const std::vector<mx::array>& inputs) const {
  const mx::array& pages = inputs[1];
  const mx::array& tables = inputs[3];
  return {pages, inputs[2], pages.shape(2), tables.shape(1) * pages.shape(1), {0, 2, 1, 3}, &tables};
}

mx::array PagedDecodeAttention::fallback(const std::vector<mx::array>& inputs) {
  return reference_paged_attention(
      call_queries(inputs), inputs[1], inputs[2], inputs[3], valid_lens(inputs), options(inputs), stream());
}

} // namespace mlx_batched_decode
