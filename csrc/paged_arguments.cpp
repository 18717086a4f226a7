#include "paged_arguments.h"

#include <climits>
#include <string>

namespace mlx_batched_decode {

namespace {

constexpr const char* kOp = "paged_decode_attention";

[[noreturn]] void fail(const std::string& what) {
  fail_argument(kOp, what);
}

} // namespace

PagedShape check_paged_arguments(const mx::array& queries, const mx::array& key_pages, const mx::array& value_pages,
                                 const mx::array& block_tables, const mx::array& valid_lens,
                                 const DecodeOptions& options) {
  DecodeShape d = check_queries(kOp, queries);
  if (key_pages.ndim() != 4) {
    fail("key_pages must have shape [num_blocks, block_size, H_kv, D], got " + shape_str(key_pages) + ".");
  }
  if (value_pages.ndim() != 4 || value_pages.shape(0) != key_pages.shape(0) ||
      value_pages.shape(1) != key_pages.shape(1) || value_pages.shape(2) != key_pages.shape(2)) {
    fail("value_pages must have the shape of key_pages " + shape_str(key_pages) + " but for the last axis, got " +
         shape_str(value_pages) + ".");
  }
  PagedShape p{d, key_pages.shape(0), key_pages.shape(1), 0};
  if (p.num_blocks < 1 || p.block_size < 1) {
    fail("key_pages must hold at least one block of at least one row, got " + shape_str(key_pages) + ".");
  }
  if (key_pages.shape(3) != d.D) {
    fail("key_pages have head dim " + std::to_string(key_pages.shape(3)) + " but queries have " +
         std::to_string(d.D) + ".");
  }
  d.H_kv = key_pages.shape(2);
  d.Dv = value_pages.shape(3);
  check_heads(kOp, d);
  if (key_pages.dtype() != queries.dtype() || value_pages.dtype() != queries.dtype()) {
    fail("queries, key_pages and value_pages must share one dtype, got " + dtype_str(queries.dtype()) + ", " +
         dtype_str(key_pages.dtype()) + " and " + dtype_str(value_pages.dtype()) + ".");
  }
  if (block_tables.ndim() != 2 || block_tables.shape(0) != d.B || block_tables.shape(1) < 1) {
    fail("block_tables must have shape [B, max_blocks] = (" + std::to_string(d.B) + ", >= 1), got " +
         shape_str(block_tables) + ".");
  }
  if (block_tables.dtype() != mx::int32) {
    fail("block_tables must be int32, got " + dtype_str(block_tables.dtype()) + ".");
  }
  p.max_blocks = block_tables.shape(1);
  if (static_cast<int64_t>(p.max_blocks) * p.block_size > INT_MAX) {
    fail("max_blocks * block_size must fit in int32, got " + std::to_string(p.max_blocks) + " * " +
         std::to_string(p.block_size) + ".");
  }
  d.T = p.max_blocks * p.block_size;
  if (options.kv_starts) {
    fail("kv_starts is not an option of the paged layout: a request's table starts at its first key.");
  }
  reject_ring(kOp, options);
  check_options(kOp, d, valid_lens, options);
  p.d = d;
  return p;
}

} // namespace mlx_batched_decode
