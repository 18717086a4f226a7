#include "paged_arguments.h"

#include <climits>
#include <cmath>
#include <stdexcept>
#include <string>

#include "arguments.h"
#include "head_dims.h"

namespace mlx_batched_decode {

namespace {

[[noreturn]] void fail(const std::string& what) {
  throw std::invalid_argument("[paged_decode_attention] " + what);
}

} // namespace

PagedShape check_paged_arguments(
    const mx::array& queries,
    const mx::array& key_pages,
    const mx::array& value_pages,
    const mx::array& block_tables,
    const mx::array& valid_lens,
    std::optional<float> scale,
    std::optional<int> window,
    const std::optional<mx::array>& sinks) {
  if (queries.ndim() != 4) {
    fail("queries must have shape [B, H_q, L, D], got " + shape_str(queries) + ".");
  }
  if (key_pages.ndim() != 4) {
    fail("key_pages must have shape [num_blocks, block_size, H_kv, D], got " + shape_str(key_pages) + ".");
  }
  if (value_pages.shape() != key_pages.shape()) {
    fail("value_pages must have the shape of key_pages " + shape_str(key_pages) + ", got " +
         shape_str(value_pages) + ".");
  }
  PagedShape d{queries.shape(0), queries.shape(1), key_pages.shape(2), 0, queries.shape(2), queries.shape(3),
               key_pages.shape(0), key_pages.shape(1), 0, 0};
  if (d.L < 1) {
    fail("queries must have at least one row per request (L >= 1), got " + shape_str(queries) + ".");
  }
  if (d.num_blocks < 1 || d.block_size < 1) {
    fail("key_pages must hold at least one block of at least one row, got " + shape_str(key_pages) + ".");
  }
  if (key_pages.shape(3) != d.D) {
    fail("key_pages have head dim " + std::to_string(key_pages.shape(3)) + " but queries have " +
         std::to_string(d.D) + ".");
  }
  if (d.H_q < 1 || d.H_kv < 1 || d.H_q % d.H_kv != 0) {
    fail("the number of query heads (" + std::to_string(d.H_q) +
         ") must be a positive multiple of the number of key/value heads (" + std::to_string(d.H_kv) + ").");
  }
  d.G = d.H_q / d.H_kv;
  if (d.D < 1 || d.D > kMaxHeadDim) {
    fail("head dim " + std::to_string(d.D) + " is not supported; head dims 1 to " + std::to_string(kMaxHeadDim) +
         " are.");
  }
  if (!is_supported_dtype(queries.dtype())) {
    fail("queries must be float16, bfloat16 or float32, got " + dtype_str(queries.dtype()) + ".");
  }
  if (key_pages.dtype() != queries.dtype() || value_pages.dtype() != queries.dtype()) {
    fail("queries, key_pages and value_pages must share one dtype, got " + dtype_str(queries.dtype()) + ", " +
         dtype_str(key_pages.dtype()) + " and " + dtype_str(value_pages.dtype()) + ".");
  }
  if (block_tables.ndim() != 2 || block_tables.shape(0) != d.B || block_tables.shape(1) < 1) {
    fail("block_tables must have shape [B, max_blocks] = (" + std::to_string(d.B) +
         ", >= 1), got " + shape_str(block_tables) + ".");
  }
  if (block_tables.dtype() != mx::int32) {
    fail("block_tables must be int32, got " + dtype_str(block_tables.dtype()) + ".");
  }
  d.max_blocks = block_tables.shape(1);
  if (static_cast<int64_t>(d.max_blocks) * d.block_size > INT_MAX) {
    fail("max_blocks * block_size must fit in int32, got " + std::to_string(d.max_blocks) + " * " +
         std::to_string(d.block_size) + ".");
  }
  d.T = d.max_blocks * d.block_size;
  if (valid_lens.ndim() != 1 || valid_lens.shape(0) != d.B) {
    fail("valid_lens must have shape [B] = (" + std::to_string(d.B) + ",), got " + shape_str(valid_lens) + ".");
  }
  if (!mx::issubdtype(valid_lens.dtype(), mx::integer)) {
    fail("valid_lens must have an integer dtype, got " + dtype_str(valid_lens.dtype()) + ".");
  }
  if (window && *window < 1) {
    fail("window must be >= 1, got " + std::to_string(*window) + ".");
  }
  if (sinks) {
    if (sinks->ndim() != 1 || sinks->shape(0) != d.H_q) {
      fail("sinks must have shape [H_q] = (" + std::to_string(d.H_q) + ",), got " + shape_str(*sinks) + ".");
    }
    if (!mx::issubdtype(sinks->dtype(), mx::floating)) {
      fail("sinks must have a floating dtype, got " + dtype_str(sinks->dtype()) + ".");
    }
  }
  if (scale && !std::isfinite(*scale)) {
    fail("scale must be finite, got " + std::to_string(*scale) + ".");
  }
  return d;
}

} // namespace mlx_batched_decode
