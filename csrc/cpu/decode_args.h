// Plain description of one batched decode attention call, shared by the
// scheduler and the per-instruction-set kernels (no MLX types cross here).
#pragma once

#include <algorithm>
#include <cstdint>

#include "head_dims.h"

namespace mlx_batched_decode::cpu {

enum class Dtype { float16, bfloat16, float32 };

// Head dims without a kernel of their own (head_dims.h) run the generic
// kernel, on rows zero-padded to a multiple of kGenericDimStep.
inline constexpr int kGenericDimStep = 16;

// The head dim the kernel computes with: D itself or, for the generic kernel,
// D rounded up to a multiple of kGenericDimStep.
inline int padded_head_dim(int D) {
  return is_fast_head_dim(D) ? D : (D + kGenericDimStep - 1) / kGenericDimStep * kGenericDimStep;
}

// Keys [lo, hi) of one query row; empty when hi <= lo.
struct KeyRange {
  int lo, hi;
  bool empty() const {
    return hi <= lo;
  }
};

// Keys and values in mx.quantize's affine format: DecodeArgs::keys and
// values then point at the packed uint32 words [B, H_kv, T, D * bits / 32]
// (k_stride and v_stride count words), and these at the scales and biases
// [B, H_kv, T, D / group_size] of each. Element e of a row is
// scale[e / group_size] * (its bits-wide integer) + bias[e / group_size].
struct QuantizedRows {
  int bits = 0; // 4 or 8; 0: keys and values are dense rows of the queries' dtype
  int group_size = 0;
  Dtype scales_dtype = Dtype::float32; // of the scales and biases of both
  const void* scales[2] = {}; // keys, values
  const void* biases[2] = {};
  int64_t scales_stride[2][4] = {}; // batch, head, position, group
  int64_t biases_stride[2][4] = {};

  int groups(int D) const {
    return D / group_size;
  }
};

// One buffer per request (the ragged layout): request b's keys and values are
// arrays of their own, [H_kv, length, D] with strides {0, head, position,
// dim}; positions past length are never read.
struct RequestRows {
  const void* keys;
  const void* values;
  int64_t k_stride[4];
  int64_t v_stride[4];
  int length;
};

// Dimension legend: B requests, H_q query heads, H_kv key/value heads,
// G = H_q / H_kv query heads per KV head, L query rows per request, T padded
// length, D head dim of queries and keys, Dv of values and the output. The
// R = G * L query rows of one (request, KV head) are numbered r = g * L + i
// (head g, row i), their order in the output.
// Strides are in elements and may be anything (views are read in place).
//
// Paged layout (block_tables not null): keys and values are pools
// [num_blocks, block_size, H_kv, D], k_stride and v_stride are {page, head,
// row, dim}, T = max_blocks * block_size, and position j of request b is row
// j % block_size of page block_tables[b, j / block_size] (see row_source.h).
//
// Ring (ring_offsets not null; dense layout): logical position j of request
// b is stored at slot (j + ring_offsets[b]) mod T; ranges stay logical, and
// the plan cuts each request's keys where they wrap (Chunk::shift).
//
// Ragged layout (requests not null): keys, values and their strides are
// request b's (RequestRows) in of_request(b), the description a work item of
// request b runs on; T is the longest length.
//
// Packed queries (query_starts not null): L is N, all requests' rows, and in
// of_request(b) request b's own count, its rows first_row .. of every head
// (the queries' batch stride is 0, the output [N, H_q, D]): so every loop
// that reads rows() or L runs on one request's rows.
struct DecodeArgs {
  const void* queries; // [B, H_q, L, D]
  const void* keys; // [B, H_kv, T, D], or a pool
  const void* values; // [B, H_kv, T, D], or a pool
  const int32_t* block_tables = nullptr; // [B, max_blocks] or null (dense)
  const RequestRows* requests = nullptr; // [B] or null (one array for all requests)
  int64_t table_stride[2] = {0, 0};
  int block_size = 0, num_blocks = 0;
  const int32_t* valid_lens; // [B], clamped to [0, T] by the kernel
  const int32_t* kv_starts; // [B] or null (0), clamped to [0, T] by the kernel
  const float* sinks; // [H_q] or null
  const int32_t* ring_offsets = nullptr; // [B] or null, in [0, T) (the op takes them modulo T)
  const int32_t* query_starts = nullptr; // [B + 1] or null (rows of one count L per request)
  void* out; // [B, H_q, L, D] or, packed, [N, H_q, D]: see out_stride
  Dtype dtype;
  int B, H_q, H_kv, G, L, T, D;
  int Dp; // padded_head_dim(D)
  int Dv, Dvp; // the values' head dim (the output's, the accumulators') and padded_head_dim(Dv)
  int window; // effective_window(): in [1, T], T (or 1) when the layer has none
  int64_t q_stride[4]; // batch, head, row, dim
  int64_t k_stride[4]; // batch, head, position, dim (paged: page, head, row, dim)
  int64_t v_stride[4];
  int64_t lens_stride;
  int64_t starts_stride;
  int64_t sinks_stride;
  int64_t ring_stride = 0;
  int64_t query_starts_stride = 0;
  int64_t out_stride[3]; // request, head, row (0 for the request when packed); the last axis contiguous
  int first_row = 0; // packed: the first of this request's rows (of_request)
  float scale;
  float softcap = 0.0f; // > 0: scores s become softcap * tanh(s / softcap); 0: none
  QuantizedRows quant; // bits == 0 for dense keys and values
  bool amx_tiles = false; // the AMX variant: 16-bit blocks may run on AMX tiles

  int rows() const {
    return G * L;
  }
  // Values of the keys' head dim and the output [B, H_q, L, D] row after row:
  // what a description without packed rows or narrower values sets.
  void same_head_dims() {
    Dv = D;
    Dvp = Dp;
    out_stride[0] = static_cast<int64_t>(H_q) * L * D;
    out_stride[1] = static_cast<int64_t>(L) * D;
    out_stride[2] = D;
  }
  // Whether a work item of `rows` query rows (more than rows() where requests
  // share pages) may run on the AMX tiles. With fewer the vector path costs
  // less (measured on the development VM: splitting float16 keys and values
  // into bfloat16 parts costs about what 8 rows of vector arithmetic do), and
  // float32 and packed keys keep it.
  bool tiles_for(int rows) const {
    const int fewest = dtype == Dtype::float16 ? 12 : 8;
    return amx_tiles && quant.bits == 0 && dtype != Dtype::float32 && D == Dv && rows >= fewest;
  }
  // This description with the values' head dim as D: what the value side's
  // loads, which gather and pad rows of D elements, read through.
  DecodeArgs value_rows() const {
    DecodeArgs v = *this;
    v.D = Dv;
    v.Dp = Dvp;
    return v;
  }
  // valid_lens[b] clamped to [0, T], and to request b's length in the ragged layout.
  int length(int b) const {
    const int len = clamp_position(valid_lens[b * lens_stride]);
    return requests ? std::min(len, std::max(requests[b].length, 0)) : len;
  }
  int start(int b) const {
    return kv_starts ? clamp_position(kv_starts[b * starts_stride]) : 0;
  }
  // Where logical position 0 of request b is stored, in [0, T): taken modulo T
  // again, so that no offset, however wrong, moves a read out of the ring.
  int ring_slot(int b) const {
    if (ring_offsets == nullptr || T <= 0) {
      return 0;
    }
    const int64_t r = ring_offsets[b * ring_stride] % T;
    return static_cast<int>(r < 0 ? r + T : r);
  }
  // Row i of request b sits at p = len - L + i and attends max(start, p - window + 1, 0) .. p.
  KeyRange row_range(int len, int start, int i) const {
    const int p = len - L + i;
    return {std::max({start, p - window + 1, 0}), p + 1};
  }
  // The keys some row of request b attends: [lo of the first non-empty row, len).
  // Rows are empty for a prefix of i (lo - p falls as i grows), and lo grows with i.
  KeyRange request_range(int b) const {
    const int len = length(b), begin = start(b);
    for (int i = 0; i < L; ++i) {
      const KeyRange r = row_range(len, begin, i);
      if (!r.empty()) {
        return {r.lo, len};
      }
    }
    return {0, 0};
  }
  // The description request b's rows are read through: in the ragged layout,
  // its own arrays and strides (batch stride 0); with packed queries, its
  // own rows; else this one.
  DecodeArgs of_request(int b) const {
    if (requests == nullptr && query_starts == nullptr) {
      return *this;
    }
    DecodeArgs a = *this;
    if (requests != nullptr) {
      a.keys = requests[b].keys;
      a.values = requests[b].values;
      std::copy_n(requests[b].k_stride, 4, a.k_stride);
      std::copy_n(requests[b].v_stride, 4, a.v_stride);
    }
    if (query_starts != nullptr) {
      // Clamped, so that no value moves a row outside [0, N); run_decode
      // checks the starts as a whole (packed_rows_valid).
      const int first = clamp_row(query_starts[b * query_starts_stride]);
      a.first_row = first;
      a.L = std::max(clamp_row(query_starts[(b + 1) * query_starts_stride]) - first, 0);
    }
    return a;
  }
  // Packed queries: whether query_starts start at 0, never decrease and end
  // at N, so that every row is one request's (the op checks them when it can
  // read them; inside a transformation the kernel does).
  bool packed_rows_valid() const {
    if (query_starts[0] != 0 || query_starts[B * query_starts_stride] != L) {
      return false;
    }
    for (int b = 0; b < B; ++b) {
      if (query_starts[(b + 1) * query_starts_stride] < query_starts[b * query_starts_stride]) {
        return false;
      }
    }
    return true;
  }

 private:
  int clamp_position(int64_t n) const {
    return n < 0 ? 0 : (n > T ? T : static_cast<int>(n));
  }
  int clamp_row(int64_t n) const {
    return n < 0 ? 0 : (n > L ? L : static_cast<int>(n));
  }
};

// Online-softmax state of the R query rows of one (request, KV head) over a
// range of keys: running max m, running sum l and the unnormalised
// accumulator acc [rows, Dvp] (the values' padded head dim), all float32,
// stored back to back in one float buffer. Rows are allocated in whole
// groups of 16, so that the AMX path reads and writes whole tiles (rows past
// R are scratch), and so that each state and its acc start on a cache line
// where the buffer does.
struct PartialState {
  float* m;
  float* l;
  float* acc;

  static int rows(int R) {
    return (R + 15) / 16 * 16;
  }
  static int64_t size(int R, int Dp) {
    return static_cast<int64_t>(rows(R)) * (Dp + 2);
  }
  static PartialState at(float* base, int R) {
    return {base, base + rows(R), base + 2 * rows(R)};
  }
};

// Keys [t0, t1) of request b, KV head h: one work item. In the paged layout
// it may serve several requests whose tables hold the same pages over
// [t0, t1) (a shared prefix): members[0 .. count), b == members[0], each
// request's rows masked to their own ranges; null members means b alone.
//
// shift: the slot of position t is t + shift (a ring's chunk lies on one side
// of its wrap); 0 for every other layout. heads: the item covers KV heads
// [h, h + heads), at most kMaxItemHeads: rows whose heads lie side by side
// (token-major) are then read whole, each block for every head in turn.
inline constexpr int kMaxItemHeads = 16;

struct Chunk {
  int b, h, t0, t1;
  const int* members = nullptr;
  int count = 1;
  int shift = 0;
  int heads = 1;

  int request(int m) const {
    return members ? members[m] : b;
  }
};

// Attends the query rows of c's count requests (R = G * L each, request m's
// at rows m * R ..) to keys [c.t0, c.t1) of heads c.h .. c.h + c.heads - 1
// and stores the states, states[i] head c.h + i's. next, if not null, is the
// chunk this thread runs after it: its first rows are requested from memory
// while this one ends.
using ChunkFn = void (*)(const DecodeArgs&, const Chunk& c, PartialState* states, const Chunk* next);
// Merges the n partial states stored back to back at parts and writes the R
// output rows of (b, h); n == 0 (no key in any row) writes zeros.
using FinalizeFn = void (*)(const DecodeArgs&, int b, int h, float* parts, int n);

struct KernelFns {
  ChunkFn chunk;
  FinalizeFn finalize;
};

} // namespace mlx_batched_decode::cpu
