#include "ragged_arguments.h"

#include <algorithm>
#include <string>

namespace mlx_batched_decode {

namespace {

constexpr const char* kOp = "ragged_decode_attention";

[[noreturn]] void fail(const std::string& what) {
  fail_argument(kOp, what);
}

// "keys[3]" for messages.
std::string item(const char* list, int b) {
  return std::string(list) + "[" + std::to_string(b) + "]";
}

// Request b's array of `list`: [1, H_kv, T_b, D] or [H_kv, T_b, D], of the
// queries' dtype, of head dim D and of the first request's H_kv.
void check_request(const char* list, int b, const mx::array& a, mx::Dtype dtype, int D, int H_kv) {
  if (a.ndim() != 3 && a.ndim() != 4) {
    fail(item(list, b) + " must have shape [1, H_kv, T_b, D] or [H_kv, T_b, D], got " + shape_str(a) + ".");
  }
  if (a.ndim() == 4 && a.shape(0) != 1) {
    fail(item(list, b) + " must have a leading axis of 1 (one request), got " + shape_str(a) + ".");
  }
  if (a.dtype() != dtype) {
    fail("queries, keys and values must share one dtype: queries are " + dtype_str(dtype) + " but " +
         item(list, b) + " is " + dtype_str(a.dtype()) + ".");
  }
  const int off = a.ndim() - 3;
  if (a.shape(off + 2) != D) {
    fail(item(list, b) + " has head dim " + std::to_string(a.shape(off + 2)) + " but " +
         (list[0] == 'k' ? "queries have " : "values[0] has ") + std::to_string(D) + ".");
  }
  if (a.shape(off) != H_kv) {
    fail(item(list, b) + " has " + std::to_string(a.shape(off)) + " key/value heads but keys[0] has " +
         std::to_string(H_kv) + ".");
  }
}

} // namespace

RaggedShape check_ragged_arguments(const mx::array& queries, const std::vector<mx::array>& keys,
                                   const std::vector<mx::array>& values, const std::optional<mx::array>& valid_lens,
                                   const DecodeOptions& options) {
  RaggedShape r{check_queries(kOp, queries), {}};
  DecodeShape& d = r.d;
  if (static_cast<int>(keys.size()) != d.B || static_cast<int>(values.size()) != d.B) {
    fail("keys and values must be lists of B = " + std::to_string(d.B) + " arrays (one per request), got " +
         std::to_string(keys.size()) + " and " + std::to_string(values.size()) + ".");
  }
  if (d.B == 0) {
    return r;
  }
  d.H_kv = keys[0].ndim() >= 3 ? keys[0].shape(keys[0].ndim() - 3) : 0;
  d.Dv = values[0].ndim() >= 3 ? values[0].shape(-1) : 0;
  for (int b = 0; b < d.B; ++b) {
    check_request("keys", b, keys[b], queries.dtype(), d.D, d.H_kv);
    // Values may have a head dim of their own, the same for every request.
    const mx::array& v = values[b];
    if (v.ndim() != keys[b].ndim() ||
        !std::equal(keys[b].shape().begin(), keys[b].shape().end() - 1, v.shape().begin())) {
      fail(item("values", b) + " must have the shape of " + item("keys", b) + " " + shape_str(keys[b]) +
           " but for the last axis, got " + shape_str(v) + ".");
    }
    check_request("values", b, v, queries.dtype(), d.Dv, d.H_kv);
    r.lengths.push_back(keys[b].shape(keys[b].ndim() - 2));
  }
  d.T = *std::max_element(r.lengths.begin(), r.lengths.end());
  check_heads(kOp, d);
  reject_ring(kOp, options);
  check_options(kOp, d, ragged_lengths(valid_lens, r), options);
  return r;
}

mx::array ragged_lengths(const std::optional<mx::array>& valid_lens, const RaggedShape& r) {
  if (valid_lens) {
    return *valid_lens;
  }
  return mx::array(r.lengths.begin(), {static_cast<int>(r.lengths.size())}, mx::int32);
}

} // namespace mlx_batched_decode
