// reference_paged_attention: the paged op's contract in plain MLX ops. The
// pages are gathered into a dense [B, H_kv, T, D] cache and the positions whose
// table entry lies outside the pool are masked out of every row's range.
#include "mlx/ops.h"
#include "paged_arguments.h"
#include "paged_decode_attention.h"
#include "reference_attention.h"

namespace mlx_batched_decode {

mx::array reference_paged_attention(const mx::array& packed, const mx::array& key_pages,
                                    const mx::array& value_pages, const mx::array& block_tables,
                                    const mx::array& valid_lens, const DecodeOptions& options, mx::StreamOrDevice s) {
  const mx::array queries = request_queries(
      "paged_decode_attention", packed, options, block_tables.ndim() == 2 ? block_tables.shape(0) : 0, s);
  const PagedShape p = check_paged_arguments(queries, key_pages, value_pages, block_tables, valid_lens, options);
  const DecodeShape& d = p.d;
  // [B, MB]: entries outside the pool read block 0 and are masked below.
  auto in_pool = mx::logical_and(
      mx::greater_equal(block_tables, mx::array(0), s), mx::less(block_tables, mx::array(p.num_blocks), s), s);
  // The table is an index, not a value: no gradient flows into it.
  auto blocks = mx::stop_gradient(mx::where(in_pool, block_tables, mx::array(0), s), s);
  auto dense = [&](const mx::array& pages) {
    auto rows = mx::take(pages, mx::flatten(blocks, s), 0, s); // [B * MB, BS, H_kv, D]
    return mx::transpose(mx::reshape(rows, {d.B, d.T, d.H_kv, pages.shape(3)}, s), {0, 2, 1, 3}, s);
  };
  auto key_mask = mx::reshape(
      mx::broadcast_to(mx::expand_dims(in_pool, 2, s), {d.B, p.max_blocks, p.block_size}, s), {d.B, d.T}, s);
  auto lens = mx::clip(mx::astype(valid_lens, mx::int64, s), mx::array(0, mx::int64), mx::array(d.T, mx::int64), s);
  return masked_reference_attention(
      queries, dense(key_pages), dense(value_pages), mx::astype(lens, mx::int32, s), options, key_mask, s);
}

} // namespace mlx_batched_decode
