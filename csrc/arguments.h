// Argument checks shared by the ops of the family and their references.
//
// Dimension legend: B requests, H_q query heads, H_kv key/value heads,
// G = H_q / H_kv, L query rows per request, T padded length, D head dim.
#pragma once

#include <optional>
#include <string>

#include "decode_options.h"
#include "mlx/array.h"
#include "mlx/utils.h"

namespace mlx_batched_decode {

// D: the head dim of queries and keys; Dv: of values and the output.
struct DecodeShape {
  int B, H_q, H_kv, G, L, T, D;
  int Dv = 0;
};

// Checks ranks, shapes, head counts, head dim, dtypes and the options of a
// dense call and returns its dimensions; throws std::invalid_argument whose
// message starts with "[batched_decode_attention]" and names the offending
// argument.
DecodeShape check_arguments(const mx::array& queries, const mx::array& keys, const mx::array& values,
                            const mx::array& valid_lens, const DecodeOptions& options);

// The parts of those checks every op makes, for an op named `op` (the prefix
// of its messages). check_queries: queries [B, H_q, L >= 1, D] of a supported
// dtype; its B, H_q, L and D. check_heads, once H_kv and Dv are set: H_q a
// positive multiple of H_kv (sets G), Dv in [1, kMaxHeadDim] and D in [1,
// kMaxHeadDim], or up to kMaxKeyHeadDim where Dv differs. check_options: the
// per-request positions, window, sinks, ring offset, scale and softcap; reject_ring:
// the error of a layout that takes no ring_offset.
DecodeShape check_queries(const std::string& op, const mx::array& queries);
void check_heads(const std::string& op, DecodeShape& d);
void check_options(const std::string& op, const DecodeShape& d, const mx::array& valid_lens, const DecodeOptions& options);
void reject_ring(const std::string& op, const DecodeOptions& options);

// The queries as the primitives take them. Without query_starts, queries
// unchanged. With it (B requests): checks packed queries [N, H_q, D], N >= 1,
// and query_starts, integer [B + 1] whose values (read here, unless they are
// traced by a transformation, when the kernels clamp them instead) start at
// 0, never decrease and end at N; returns the view [B, H_q, N, D] of the
// queries with batch stride 0, request b's rows being rows query_starts[b] ..
// query_starts[b + 1] - 1 of its entry.
mx::array request_queries(const std::string& op, const mx::array& queries, const DecodeOptions& options, int B,
                          mx::StreamOrDevice s);
// The packed queries [N, H_q, D] of such a view, for the fallbacks: its first
// entry (gradients flow back through the view to all of them).
mx::array packed_queries(const mx::array& view, mx::StreamOrDevice s);

// Throws std::invalid_argument("[op] what").
[[noreturn]] void fail_argument(const std::string& op, const std::string& what);
// "(2, 3)" and "float16", for messages.
std::string shape_str(const mx::array& a);
std::string dtype_str(mx::Dtype t);
// float16, bfloat16 or float32.
bool is_supported_dtype(mx::Dtype t);

// Per-request positions (valid_lens, kv_starts) as int32 [B]: values of wider
// dtypes are clamped to [0, T] first, so that 2^32 + 2 means "all of T"
// rather than wrapping to 2.
mx::array positions_as_int32(const mx::array& positions, int T, mx::StreamOrDevice s);

// A ring offset (an integer scalar or [B]) as int32 [B] in [0, T): taken
// modulo T in its own dtype first, so that offsets of any size wrap exactly.
mx::array ring_offsets_as_int32(const mx::array& ring_offset, int B, int T, mx::StreamOrDevice s);

// The scale to use: the given one or 1/sqrt(D).
float resolve_scale(std::optional<float> scale, int head_dim);

} // namespace mlx_batched_decode
