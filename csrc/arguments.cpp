#include "arguments.h"

#include <algorithm>
#include <cmath>
#include <sstream>
#include <stdexcept>
#include <vector>

#include "head_dims.h"
#include "mlx/ops.h"
#include "mlx/utils.h"

namespace mlx_batched_decode {

namespace {

constexpr const char* kOp = "batched_decode_attention";

[[noreturn]] void fail(const std::string& what) {
  fail_argument(kOp, what);
}

// Per-request positions (valid_lens, kv_starts): integer [B].
void check_positions(const std::string& op, const mx::array& a, const std::string& name, int B) {
  if (a.ndim() != 1 || a.shape(0) != B) {
    fail_argument(op, name + " must have shape [B] = (" + std::to_string(B) + ",), got " + shape_str(a) + ".");
  }
  if (!mx::issubdtype(a.dtype(), mx::integer)) {
    fail_argument(op, name + " must have an integer dtype, got " + dtype_str(a.dtype()) + ".");
  }
}

} // namespace

[[noreturn]] void fail_argument(const std::string& op, const std::string& what) {
  throw std::invalid_argument("[" + op + "] " + what);
}

std::string shape_str(const mx::array& a) {
  std::ostringstream s;
  s << "(";
  for (size_t i = 0; i < a.ndim(); ++i) {
    s << (i ? ", " : "") << a.shape(i);
  }
  s << (a.ndim() == 1 ? ",)" : ")");
  return s.str();
}

std::string dtype_str(mx::Dtype t) {
  std::ostringstream s;
  s << t;
  return s.str();
}

bool is_supported_dtype(mx::Dtype t) {
  return t == mx::float16 || t == mx::bfloat16 || t == mx::float32;
}

DecodeShape check_queries(const std::string& op, const mx::array& queries) {
  if (queries.ndim() != 4) {
    fail_argument(op, "queries must have shape [B, H_q, L, D], got " + shape_str(queries) + ".");
  }
  if (!is_supported_dtype(queries.dtype())) {
    fail_argument(op, "queries must be float16, bfloat16 or float32, got " + dtype_str(queries.dtype()) + ".");
  }
  if (queries.shape(2) < 1) {
    fail_argument(op, "queries must have at least one row per request (L >= 1), got " + shape_str(queries) + ".");
  }
  return {queries.shape(0), queries.shape(1), 0, 0, queries.shape(2), 0, queries.shape(3)};
}

void check_heads(const std::string& op, DecodeShape& d) {
  if (d.H_q < 1 || d.H_kv < 1 || d.H_q % d.H_kv != 0) {
    fail_argument(op, "the number of query heads (" + std::to_string(d.H_q) +
                  ") must be a positive multiple of the number of key/value heads (" + std::to_string(d.H_kv) +
                  ").");
  }
  d.G = d.H_q / d.H_kv;
  if (d.D == d.Dv && (d.D < 1 || d.D > kMaxHeadDim)) {
    fail_argument(op, "head dim " + std::to_string(d.D) + " is not supported; head dims 1 to " +
                  std::to_string(kMaxHeadDim) + " are.");
  }
  if (d.D < 1 || d.D > kMaxKeyHeadDim) {
    fail_argument(op, "the keys' head dim " + std::to_string(d.D) + " is not supported; 1 to " +
                  std::to_string(kMaxKeyHeadDim) + " are.");
  }
  if (d.Dv < 1 || d.Dv > kMaxHeadDim) {
    fail_argument(op, "the values' head dim " + std::to_string(d.Dv) + " is not supported; 1 to " +
                  std::to_string(kMaxHeadDim) + " are.");
  }
}

void check_options(const std::string& op, const DecodeShape& d, const mx::array& valid_lens, const DecodeOptions& o) {
  check_positions(op, valid_lens, "valid_lens", d.B);
  if (o.kv_starts) {
    check_positions(op, *o.kv_starts, "kv_starts", d.B);
  }
  if (o.window && *o.window < 1) {
    fail_argument(op, "window must be >= 1, got " + std::to_string(*o.window) + ".");
  }
  if (o.sinks) {
    if (o.sinks->ndim() != 1 || o.sinks->shape(0) != d.H_q) {
      fail_argument(op, "sinks must have shape [H_q] = (" + std::to_string(d.H_q) + ",), got " +
                    shape_str(*o.sinks) + ".");
    }
    if (!mx::issubdtype(o.sinks->dtype(), mx::floating)) {
      fail_argument(op, "sinks must have a floating dtype, got " + dtype_str(o.sinks->dtype()) + ".");
    }
  }
  if (o.ring_offset) {
    const mx::array& r = *o.ring_offset;
    if (!(r.ndim() == 0 || (r.ndim() == 1 && r.shape(0) == d.B)) || !mx::issubdtype(r.dtype(), mx::integer)) {
      fail_argument(op, "ring_offset must be an int or an integer [B] = (" + std::to_string(d.B) +
                    ",) array, got " + (r.ndim() == 0 ? "a scalar" : "shape " + shape_str(r)) + " of " +
                    dtype_str(r.dtype()) + ".");
    }
  }
  if (o.scale && !std::isfinite(*o.scale)) {
    fail_argument(op, "scale must be finite, got " + std::to_string(*o.scale) + ".");
  }
  if (o.softcap && !(std::isfinite(*o.softcap) && *o.softcap > 0.0f)) {
    fail_argument(op, "softcap must be a finite number > 0, got " + std::to_string(*o.softcap) + ".");
  }
}

mx::array request_queries(const std::string& op, const mx::array& queries, const DecodeOptions& o, int B,
                          mx::StreamOrDevice s) {
  if (!o.query_starts) {
    return queries;
  }
  const mx::array& qs = *o.query_starts;
  if (queries.ndim() != 3) {
    fail_argument(op, "queries must have shape [N, H_q, D] with query_starts, got " + shape_str(queries) + ".");
  }
  const int N = queries.shape(0);
  if (N < 1) {
    fail_argument(op, "queries must have at least one row (N >= 1), got " + shape_str(queries) + ".");
  }
  if (qs.ndim() != 1 || qs.shape(0) != B + 1) {
    fail_argument(op, "query_starts must have shape [B + 1] = (" + std::to_string(B + 1) + ",), got " +
                  shape_str(qs) + ".");
  }
  if (!mx::issubdtype(qs.dtype(), mx::integer)) {
    fail_argument(op, "query_starts must have an integer dtype, got " + dtype_str(qs.dtype()) + ".");
  }
  // B + 1 integers, read before any work of this call is queued: in place when they are evaluated
  // int32 (the decoder's, no evaluation), else through one small evaluation.
  if (!qs.is_tracer()) {
    std::vector<int64_t> x(B + 1);
    if (qs.is_available() && qs.dtype() == mx::int32) {
      const int32_t* p = qs.data<int32_t>();
      for (int b = 0; b <= B; ++b) {
        x[b] = p[b * qs.strides(0)];
      }
    } else {
      mx::array v = mx::astype(qs, mx::int64, mx::Device::cpu);
      v.eval();
      std::copy_n(v.data<int64_t>(), B + 1, x.begin());
    }
    if (x[0] != 0 || x[B] != N) {
      fail_argument(op, "query_starts must start at 0 and end at N = " + std::to_string(N) + ", got " +
                    std::to_string(x[0]) + " .. " + std::to_string(x[B]) + ".");
    }
    for (int b = 0; b < B; ++b) {
      if (x[b + 1] < x[b]) {
        fail_argument(op, "query_starts must not decrease, got " + std::to_string(x[b]) + " then " +
                      std::to_string(x[b + 1]) + " at request " + std::to_string(b) + ".");
      }
    }
  }
  return mx::broadcast_to(mx::expand_dims(mx::transpose(queries, {1, 0, 2}, s), 0, s),
                          {B, queries.shape(1), N, queries.shape(2)}, s);
}

mx::array packed_queries(const mx::array& view, mx::StreamOrDevice s) {
  const mx::array first =
      mx::squeeze(mx::slice(view, {0, 0, 0, 0}, {1, view.shape(1), view.shape(2), view.shape(3)}, s), 0, s);
  return mx::transpose(first, {1, 0, 2}, s);
}

void reject_ring(const std::string& op, const DecodeOptions& options) {
  if (options.ring_offset) {
    fail_argument(op, "ring_offset is an option of the dense layout (batched_decode_attention) only.");
  }
}

DecodeShape check_arguments(const mx::array& queries, const mx::array& keys, const mx::array& values,
                            const mx::array& valid_lens, const DecodeOptions& options) {
  DecodeShape d = check_queries(kOp, queries);
  if (keys.ndim() != 4) {
    fail("keys must have shape [B, H_kv, T, D], got " + shape_str(keys) + ".");
  }
  // Values may have a head dim of their own (MLA's latent, a view of the keys' first columns).
  if (values.ndim() != 4 || values.shape(0) != keys.shape(0) || values.shape(1) != keys.shape(1) ||
      values.shape(2) != keys.shape(2)) {
    fail("values must have the shape of keys " + shape_str(keys) + " but for the last axis, got " +
         shape_str(values) + ".");
  }
  if (keys.shape(0) != d.B) {
    fail("keys have batch size " + std::to_string(keys.shape(0)) + " but queries have " + std::to_string(d.B) + ".");
  }
  if (keys.shape(3) != d.D) {
    fail("keys have head dim " + std::to_string(keys.shape(3)) + " but queries have " + std::to_string(d.D) + ".");
  }
  d.H_kv = keys.shape(1);
  d.T = keys.shape(2);
  d.Dv = values.shape(3);
  check_heads(kOp, d);
  if (keys.dtype() != queries.dtype() || values.dtype() != queries.dtype()) {
    fail("queries, keys and values must share one dtype, got " + dtype_str(queries.dtype()) + ", " +
         dtype_str(keys.dtype()) + " and " + dtype_str(values.dtype()) + ".");
  }
  check_options(kOp, d, valid_lens, options);
  return d;
}

mx::array positions_as_int32(const mx::array& positions, int T, mx::StreamOrDevice s) {
  const mx::Dtype t = positions.dtype();
  if (t == mx::int32) {
    return positions;
  }
  // int8/16 and uint8/16 convert exactly; wider ones may not, so clamp first,
  // with bounds of their own dtype (T <= INT32_MAX fits in all of them).
  if (t.size() >= 4) {
    return mx::astype(mx::clip(positions, mx::array(0, t), mx::array(T, t), s), mx::int32, s);
  }
  return mx::astype(positions, mx::int32, s);
}

mx::array ring_offsets_as_int32(const mx::array& ring_offset, int B, int T, mx::StreamOrDevice s) {
  const mx::Dtype t = ring_offset.dtype();
  // Python's modulo (never negative), with T = 0 (no key to read) as 1.
  auto wrapped = mx::remainder(ring_offset, mx::array(std::max(T, 1), t), s);
  return mx::broadcast_to(mx::astype(wrapped, mx::int32, s), {B}, s);
}

float resolve_scale(std::optional<float> scale, int head_dim) {
  return scale.value_or(1.0f / std::sqrt(static_cast<float>(head_dim)));
}

} // namespace mlx_batched_decode
