// Metal launcher of PagedDecodeAttention: the dense op's launch with the
// pools as the row source (PagedLayout) and block_tables bound in the
// kv_starts slot. A block shared by several requests is read once per request.
#include "mlx/allocator.h"

#include "../batched_decode_attention.h"
#include "../paged_decode_attention.h"
#include "decode_launch.h"
#include "launch_plan.h"

namespace mlx_batched_decode {

void PagedDecodeAttention::eval_gpu(const std::vector<mx::array>& inputs, mx::array& out) {
  const mx::array& queries = inputs[0];
  const mx::array& key_pages = inputs[1];
  const mx::array& value_pages = inputs[2];
  const mx::array& block_tables = inputs[3];
  const mx::array& valid_lens = inputs[4];
  const mx::array& sinks = has_sinks_ ? inputs[5] : valid_lens;
  if (out.size() == 0) {  // B == 0: nothing to launch
    out.set_data(mx::allocator::malloc(0));
    return;
  }
  check_last_axis(queries, "queries");
  check_last_axis(key_pages, "key_pages");
  check_last_axis(value_pages, "value_pages");
  const int T = block_tables.shape(1) * key_pages.shape(1);
  LaunchShape shape{
      queries.shape(0), queries.shape(1), key_pages.shape(2), queries.shape(2), T, queries.shape(3),
      effective_window(window_, T), kernel_dtype(queries.dtype()),
      /* max_threads_per_group, set by the launch */ MBD_SIMD_WIDTH, /* has_kv_starts */ false, has_sinks_};
  // Pools [page, row, head, dim]: pages take the batch stride, rows the position stride.
  const InputStrides strides{queries.strides(0),     queries.strides(1),     queries.strides(2),
                             key_pages.strides(0),   key_pages.strides(2),   key_pages.strides(1),
                             value_pages.strides(0), value_pages.strides(2), value_pages.strides(1),
                             valid_lens.strides(0),  0,                      sinks.strides(0)};
  const InputOffsets offsets{queries.offset(), key_pages.offset(), value_pages.offset()};
  const PagedLayout paged{key_pages.shape(1), key_pages.shape(0), block_tables.strides(0), block_tables.strides(1)};
  launch_decode_attention(stream(), name(), shape, strides, offsets, paged, scale_,
                          {queries, key_pages, value_pages, valid_lens, block_tables, sinks}, out);
}

} // namespace mlx_batched_decode
