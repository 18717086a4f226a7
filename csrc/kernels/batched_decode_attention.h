// Batched decode attention: L query rows per request, each over its own range
// of keys (causal end, kv_starts, window), sinks, GQA read-once, split-K.
//
// Dimensions: B requests, H_q query heads, H_kv key/value heads,
// G = H_q / H_kv query heads per KV head, L query rows per request,
// R = G * L query rows per (request, KV head), T cache positions, D head dim
// of queries and keys, Dv of values and the output (MLA: 576 and 512).
// Row i of request b sits at p = len_b - L + i and attends the keys
// max(start_b, p - window + 1) .. p; a sink logit joins its softmax denominator.
// With a softcap c > 0, each score s becomes c * tanh(s / c) (the sink does not).
// Packed queries (p.has_query_starts): request b brings L = q_b rows of its own,
// rows query_starts[b] .. query_starts[b + 1] - 1 of the N packed ones.
//
// One threadgroup per (split, KV head x row group, request), or, packed, per
// (split, KV head x row block): see bda_block_request. The R rows,
// ordered by i and then g, are cut into row chunks of bda_rows (one
// simdgroup's); a row group is the run of chunks one threadgroup holds, all R
// unless the thread limit or 8 chunks cut them. Its rows cover consecutive i,
// whose key ranges join into one interval, the only keys it reads, each once.
// Each lane owns a slice of the D (and Dv) columns, so a K/V row is one vector
// load per lane and serves every row of the chunk, each row masked to its own range. Softmax
// state is float32. Packed queries of many rows take the tiled path instead
// (bda_attend_tiles: simdgroup-matrix products over tiles of 32 rows), after the same prologue.
//
// Non-finite values follow the softmax of reference_attention: a NaN score
// makes its row NaN, a -inf score weighs 0, and a row whose scores are all -inf
// (with no finite sink) is 0/0 = NaN; a row with no key at all gives zeros.
// That needs IEEE infinities: the metallib is built with -fno-fast-math, and
// MLX compiles the run-time source in its safe math mode.
#pragma once

#include <metal_stdlib>

#include "batched_decode_attention_params.h"
#include "quantized_batched_decode_attention_params.h"
#include "ragged_decode_attention_params.h"

using namespace metal;

using mlx_batched_decode::BatchedDecodeParams;
using mlx_batched_decode::QuantizedDecodeParams;
using mlx_batched_decode::RaggedGroupParams;
using mlx_batched_decode::RaggedRequest;

// Query rows one simdgroup holds (a row chunk), fixed per pipeline so that the
// registers of rows it never holds are compiled away.
constant int bda_rows [[function_constant(MBD_FC_ROWS)]];
// Whether every Q, K and V row starts on a multiple of the vector width (the
// launch plan's vector_loads): whole vector loads, else scalar ones.
constant bool bda_vector_loads [[function_constant(MBD_FC_VECTOR_LOADS)]];
// Whether the launch takes the tiled path (the plan's tiled; kernels with bda_has_tiles only).
constant bool bda_tiled [[function_constant(MBD_FC_TILED)]];

constant float bda_inf = numeric_limits<float>::infinity();

// vec<T, N>; N = 1 is the scalar (MSL has no one-element vectors).
template <typename T, int N>
struct bda_vec {
  typedef vec<T, N> type;
};
template <typename T>
struct bda_vec<T, 1> {
  typedef T type;
};

inline float bda_dot(float a, float b) {
  return a * b;
}
inline float bda_dot(float2 a, float2 b) {
  return dot(a, b);
}
inline float bda_dot(float4 a, float4 b) {
  return dot(a, b);
}
inline float bda_element(float a, int) {
  return a;
}
inline float bda_element(float2 a, int e) {
  return a[e];
}
inline float bda_element(float4 a, int e) {
  return a[e];
}

// V consecutive elements of a row as floats (V = 1, 2 or 4): one vector load
// when `vector` (bda_vector_loads, read in the kernel), else V scalar loads.
template <typename T, int V>
struct bda_load;
template <typename T>
struct bda_load<T, 1> {
  static float row(const device T* x, bool) {
    return float(x[0]);
  }
};
template <typename T>
struct bda_load<T, 2> {
  static float2 row(const device T* x, bool vector) {
    return vector ? float2(*reinterpret_cast<const device vec<T, 2>*>(x)) : float2(float(x[0]), float(x[1]));
  }
};
template <typename T>
struct bda_load<T, 4> {
  static float4 row(const device T* x, bool vector) {
    return vector ? float4(*reinterpret_cast<const device vec<T, 4>*>(x))
                  : float4(float(x[0]), float(x[1]), float(x[2]), float(x[3]));
  }
};

// exp(m - m_max) for a score or a state's max m: -inf weighs 0, where
// exp(-inf - -inf) would be NaN; NaN stays NaN.
inline float bda_weight(float m, float m_max) {
  return m == -bda_inf ? 0.0f : exp(m - m_max);
}

// The factor of the merged accumulator of a row with keys (scores' max m, sum
// l relative to m) in its output: 1 / the softmax denominator, which the sink
// logit (-inf for none) joins; rescaled to max(m, sink) so that nothing
// overflows. Every logit -inf gives 0/0 = NaN, as the reference's softmax.
inline float bda_normalizer(float m, float l, float sink) {
  const float m_all = max(m, sink);
  const float f = bda_weight(m, m_all);
  return f / (l * f + exp(sink - m_all));
}

// Keys [lo, hi) of one query row; empty when hi <= lo.
struct BdaRange {
  int lo;
  int hi;
};

// The keys of request b: its length and first valid key.
struct BdaRequest {
  int len;
  int start;
};

// Both clamped to [0, T], so that no value, however wrong, makes a read leave
// [0, T); in the ragged layout (p.ragged, requests its table) the length is
// clamped to the request's own T_b <= T, the positions its buffers hold.
inline BdaRequest bda_request(
    const device int* valid_lens,
    const device int* kv_starts,
    const device RaggedRequest* requests,
    const constant BatchedDecodeParams& p,
    int b) {
  const int bound = p.ragged ? requests[b].length : p.seq_len;
  const int len = clamp(valid_lens[b * p.lens_stride], 0, bound);
  const int start = p.has_kv_starts ? clamp(kv_starts[b * p.starts_stride], 0, p.seq_len) : 0;
  return BdaRequest{len, start};
}

// Keys attended by row i of num_rows, in a request of len keys whose first
// valid key is start (both in [0, T]), with window in [1, max(T, 1)].
inline BdaRange bda_row_keys(int len, int start, int num_rows, int i, int window) {
  const int pos = len - num_rows + i;
  // A row before the first key has none; the test also keeps pos - window from overflowing.
  if (pos < start) {
    return BdaRange{0, 0};
  }
  return BdaRange{max(start, pos - window + 1), pos + 1};
}

// The dense layout's ring shift of request b, in [0, T): its ring offset
// taken modulo T here again, so that no value, however wrong, makes a slot
// leave [0, T); 0 without a ring (or T = 0, where no key is read).
inline int bda_ring_shift(const device int* ring_offsets, const constant BatchedDecodeParams& p, int b) {
  if (!p.has_ring_offset || p.seq_len == 0) {
    return 0;
  }
  const int r = ring_offsets[b * p.ring_stride] % p.seq_len;
  return r < 0 ? r + p.seq_len : r;
}

// The row source: where position t of request b lives in the keys and the
// values, as offsets in elements from their head (which the caller applies).
// Dense: [B, H_kv, T, D] views, position t in slot t + shift mod T (shift:
// bda_ring_shift). Paged: pools addressed by block_tables
// (BatchedDecodeParams); a position whose page lies outside the pool holds no
// key (valid is false) and is never read.
struct BdaRow {
  bool valid;
  int64_t k;
  int64_t v;
};

inline BdaRow bda_row(const device int* block_tables, const constant BatchedDecodeParams& p, int b, int t,
                      int shift) {
  if (p.block_size == 0) {
    // t and shift in [0, T): the wrap is compared, not summed, so that t + shift never overflows.
    const int slot = t < p.seq_len - shift ? t + shift : t - (p.seq_len - shift);
    return BdaRow{true, int64_t(b) * p.k_batch_stride + int64_t(slot) * p.k_seq_stride,
                  int64_t(b) * p.v_batch_stride + int64_t(slot) * p.v_seq_stride};
  }
  const int page = block_tables[b * p.table_batch_stride + (t / p.block_size) * p.table_page_stride];
  if (page < 0 || page >= p.num_blocks) {
    return BdaRow{false, 0, 0};
  }
  const int row = t % p.block_size;
  return BdaRow{true, int64_t(page) * p.k_batch_stride + int64_t(row) * p.k_seq_stride,
                int64_t(page) * p.v_batch_stride + int64_t(row) * p.v_seq_stride};
}

// Whether keys [lo, hi) of request b hold a key: always, unless paged and every
// page of the range lies outside the pool. Read only for a row whose softmax
// saw no finite score, so its cost is off the usual path.
inline bool bda_holds_key(const device int* block_tables, const constant BatchedDecodeParams& p, int b, int lo,
                          int hi) {
  if (lo >= hi) {
    return false;
  }
  if (p.block_size == 0) {
    return true;
  }
  for (int page = lo / p.block_size; page <= (hi - 1) / p.block_size; ++page) {
    const int entry = block_tables[b * p.table_batch_stride + page * p.table_page_stride];
    if (entry >= 0 && entry < p.num_blocks) {
      return true;
    }
  }
  return false;
}

// V elements per vector load of the kernels of head dims D (keys) and DV
// (values), one width for both (scalars for a generic kernel).
template <int D, int DV, bool GENERIC>
constexpr int bda_vector_width() {
  return GENERIC ? 1 : (D % 128 == 0 && DV % 128 == 0 ? 4 : 2);
}

// Packed queries: whether query_starts start at 0, never decrease and end at
// N, so that every packed row is one request's. The op checks them where it
// can read them; inside mx.compile it cannot, so every threadgroup checks the
// B + 1 values (uniform loads, few next to its keys): malformed ones give zeros.
inline bool bda_starts_valid(const device int* query_starts, const constant BatchedDecodeParams& p) {
  const int64_t s = p.query_starts_stride;
  if (query_starts[0] != 0 || query_starts[p.num_requests * s] != p.num_rows) {
    return false;
  }
  for (int b = 0; b < p.num_requests; ++b) {
    if (query_starts[(b + 1) * s] < query_starts[b * s]) {
      return false;
    }
  }
  return true;
}

// The query rows of one request: packed rows first .. first + count - 1, or
// the L rows of a request of its own (first 0).
struct BdaRows {
  int first;
  int count;
};

// Request b's packed rows, of valid starts (bda_starts_valid).
inline BdaRows bda_packed_rows(const device int* query_starts, const constant BatchedDecodeParams& p, int b) {
  const int first = query_starts[b * p.query_starts_stride];
  return BdaRows{first, query_starts[(b + 1) * p.query_starts_stride] - first};
}

// The first row block of request b (valid starts): each request's row groups
// of block_rows rows take blocks from G * query_starts[b] / block_rows + b on,
// at least as many as it needs, so that N * G / block_rows + B blocks per KV
// head cover every request (vLLM's unified attention numbers its query blocks
// so). G * N fits an int: the launch plan checks H_q * N.
inline int bda_first_block(const device int* query_starts, const constant BatchedDecodeParams& p, int block_rows,
                           int b) {
  return p.gqa_factor * query_starts[b * p.query_starts_stride] / block_rows + b;
}

// The request of row block j: the last one whose first block is <= j (first
// blocks increase with b), by binary search.
inline int bda_block_request(const device int* query_starts, const constant BatchedDecodeParams& p,
                             int block_rows, int j) {
  int lo = 0;
  int hi = p.num_requests - 1;
  while (lo < hi) {
    const int mid = (lo + hi + 1) / 2;
    if (bda_first_block(query_starts, p, block_rows, mid) <= j) {
      lo = mid;
    } else {
      hi = mid - 1;
    }
  }
  return lo;
}

// The request of packed row n (valid starts): the last one whose first row is
// <= n, which holds it (an empty request's next one starts at its own first row).
inline int bda_row_request(const device int* query_starts, const constant BatchedDecodeParams& p, int n) {
  int lo = 0;
  int hi = p.num_requests - 1;
  while (lo < hi) {
    const int mid = (lo + hi + 1) / 2;
    if (query_starts[mid * p.query_starts_stride] <= n) {
      lo = mid;
    } else {
      hi = mid - 1;
    }
  }
  return lo;
}

// The keys a threadgroup's rows group_first .. group_end - 1 (of a request's
// own.count x G, i then g) read: they cover consecutive i, whose key ranges
// join into one interval (empty: lo >= hi).
inline BdaRange bda_block_keys(BdaRequest request, BdaRows own, const constant BatchedDecodeParams& p,
                               int group_first, int group_end) {
  BdaRange keys = BdaRange{p.seq_len, 0};
  for (int i = group_first / p.gqa_factor; i <= (group_end - 1) / p.gqa_factor; ++i) {
    const BdaRange range = bda_row_keys(request.len, request.start, own.count, i, p.window);
    if (range.lo < range.hi) {
      keys.lo = min(keys.lo, range.lo);
      keys.hi = max(keys.hi, range.hi);
    }
  }
  return keys;
}

// Output row of row i of query head `head` of request b: [B, H_q, L] in
// order, or, packed, [N, H_q] at its packed row; 64-bit, as rows x Dv may pass 2^31.
inline int64_t bda_out_row(const constant BatchedDecodeParams& p, int b, BdaRows rows, int head, int i) {
  return p.has_query_starts ? int64_t(rows.first + i) * p.num_q_heads + head
                            : (int64_t(b) * p.num_q_heads + head) * p.num_rows + i;
}

// Malformed query_starts, single pass: zeros for the whole output [N, H_q, Dv],
// row block j of a KV head writing its rows j * block_rows .. of the KV
// head's N x G (i, then g), which the grid's blocks cover.
template <typename T>
inline void bda_zero_block(device T* out, const constant BatchedDecodeParams& p, int kv_head, int j,
                           int block_rows, int value_dim, uint tid, uint threads) {
  const int64_t end = min(int64_t(p.gqa_factor) * p.num_rows, int64_t(j + 1) * block_rows);
  for (int64_t f = int64_t(j) * block_rows; f < end; ++f) {
    const int64_t row = (f / p.gqa_factor) * p.num_q_heads + kv_head * p.gqa_factor + f % p.gqa_factor;
    for (uint d = tid; d < uint(value_dim); d += threads) {
      out[row * value_dim + d] = T(0.0f);
    }
  }
}

// Where the K/V rows live (the kernel's row-source axis): key(row, t, vi) and
// value(row, t, vi) give elements vi * V .. vi * V + V - 1 of position t
// (bda_row's row) of the (request, KV head) that seek(b, h) chose, as floats.
//
// Dense rows of T, read in place from strided views, or the pages of a pool
// (p.block_size > 0): bda_row gives a position's offsets from its head.
template <typename T, int V>
struct BdaDenseRows {
  typedef typename bda_vec<float, V>::type floatv;
  const device T* keys;
  const device T* values;
  int64_t k_head, v_head;
  bool vectors;

  void seek(int, int h) {
    keys += h * k_head;
    values += h * v_head;
  }
  floatv key(BdaRow row, int, int vi) const {
    return bda_load<T, V>::row(keys + row.k + vi * V, vectors);
  }
  floatv value(BdaRow row, int, int vi) const {
    return bda_load<T, V>::row(values + row.v + vi * V, vectors);
  }
};

// The buffers one dispatch of the ragged kernel binds (MBD_RAGGED_SLOTS).
template <typename T>
struct BdaSlots {
  const device T* slot[MBD_RAGGED_SLOTS];

  // A switch of constant indices, uniform across the threadgroup: a dynamic
  // index into a thread array of pointers may leave it in stack memory.
  const device T* pick(int i) const {
    switch (i) {
      case 0: return slot[0];
      case 1: return slot[1];
      case 2: return slot[2];
      case 3: return slot[3];
      case 4: return slot[4];
      case 5: return slot[5];
      case 6: return slot[6];
      case 7: return slot[7];
      case 8: return slot[8];
      case 9: return slot[9];
      case 10: return slot[10];
      case 11: return slot[11];
      case 12: return slot[12];
      case 13: return slot[13];
      case 14: return slot[14];
      default: return slot[15];
    }
  }
};

// One buffer per request (the ragged layout): request b's keys and values lie
// in slots of its group's buffers at its own offsets and strides (requests[b]),
// position t at t * seq stride from its head; bda_request bounds t by its T_b.
template <typename T, int V>
struct BdaRaggedRows {
  typedef typename bda_vec<float, V>::type floatv;
  BdaSlots<T> slots;
  const device RaggedRequest* requests;
  bool vectors;
  const device T* keys;
  const device T* values;
  int64_t k_seq, v_seq;

  void seek(int b, int h) {
    const RaggedRequest r = requests[b];
    keys = slots.pick(r.k_slot) + r.k_offset + h * r.k_head_stride;
    values = slots.pick(r.v_slot) + r.v_offset + h * r.v_head_stride;
    k_seq = r.k_seq_stride;
    v_seq = r.v_seq_stride;
  }
  floatv key(BdaRow, int t, int vi) const {
    return bda_load<T, V>::row(keys + t * k_seq + vi * V, vectors);
  }
  floatv value(BdaRow, int t, int vi) const {
    return bda_load<T, V>::row(values + t * v_seq + vi * V, vectors);
  }
};

// V floats from an array (V = 1, 2 or 4).
template <int V>
struct bda_pack;
template <>
struct bda_pack<1> {
  static float make(thread const float* x) {
    return x[0];
  }
};
template <>
struct bda_pack<2> {
  static float2 make(thread const float* x) {
    return float2(x[0], x[1]);
  }
};
template <>
struct bda_pack<4> {
  static float4 make(thread const float* x) {
    return float4(x[0], x[1], x[2], x[3]);
  }
};

// Element i of a float16 (0), bfloat16 (1) or float32 (2) array, as float.
inline float bda_read_float(const device uchar* base, int64_t i, int dtype) {
  if (dtype == 0) {
    return float(reinterpret_cast<const device half*>(base)[i]);
  }
  if (dtype == 1) {
    return float(reinterpret_cast<const device bfloat*>(base)[i]);
  }
  return reinterpret_cast<const device float*>(base)[i];
}

// mx.quantize's affine rows: element e of a row is
// scale[e / group_size] * w_e + bias[e / group_size], w_e the BITS-wide
// unsigned integer at bit (e % (32 / BITS)) * BITS of word e / (32 / BITS).
// A lane's V elements lie in one word and one group: one word, one scale and
// one bias per load, widened in registers.
template <int BITS, int V>
struct BdaQuantizedRows {
  typedef typename bda_vec<float, V>::type floatv;
  static_assert((32 / BITS) % V == 0, "a load's elements lie in one word");
  const device uint* keys;
  const device uint* values;
  const device uchar* key_scales;
  const device uchar* key_biases;
  const device uchar* value_scales;
  const device uchar* value_biases;
  int64_t k_batch, k_head, k_seq;
  int64_t v_batch, v_head, v_seq;
  // Read in place, not copied into the row source: a copy out of constant
  // memory into a member is unverified MSL (the strict compile refuses it).
  const constant QuantizedDecodeParams* q;
  int b, h;

  void seek(int request, int kv_head) {
    b = request;
    h = kv_head;
    keys += request * k_batch + kv_head * k_head;
    values += request * v_batch + kv_head * v_head;
  }
  floatv row(const device uint* words, int64_t seq, const device uchar* scales, const device uchar* biases,
             int side, int t, int vi) const {
    const int e0 = vi * V;
    const int group = e0 / q->group_size;
    const float scale = bda_read_float(
        scales, b * q->scales_stride[side][0] + h * q->scales_stride[side][1] + t * q->scales_stride[side][2] +
            group * q->scales_stride[side][3], q->scales_dtype);
    const float bias = bda_read_float(
        biases, b * q->biases_stride[side][0] + h * q->biases_stride[side][1] + t * q->biases_stride[side][2] +
            group * q->biases_stride[side][3], q->scales_dtype);
    const uint word = words[t * seq + e0 / (32 / BITS)];
    float x[V];
    for (int u = 0; u < V; ++u) {
      const uint w = (word >> (((e0 + u) % (32 / BITS)) * BITS)) & ((1u << BITS) - 1u);
      x[u] = scale * float(w) + bias;
    }
    return bda_pack<V>::make(x);
  }
  floatv key(BdaRow, int t, int vi) const {
    return row(keys, k_seq, key_scales, key_biases, 0, t, vi);
  }
  floatv value(BdaRow, int t, int vi) const {
    return row(values, v_seq, value_scales, value_biases, 1, t, vi);
  }
};

// Whether kernels of head dims (D, DV) have the tiled path: fast, D = DV, whole
// 8 x 8 tiles, and staged blocks that fit threadgroup memory.
template <int D, int DV, bool GENERIC>
constexpr bool bda_has_tiles() {
  return !GENERIC && D == DV && D % 8 == 0 && D <= MBD_TILE_MAX_DIM;
}

// Row and first column of a lane's two elements of an 8 x 8 simdgroup matrix
// (the second one column right): the layout MLX's steel kernels rely on.
struct BdaTileCoord {
  int row;
  int col;
};
inline BdaTileCoord bda_tile_coord(uint lane) {
  const int quad = int(lane) / 4;
  return BdaTileCoord{(quad & 4) + (int(lane) / 2) % 4, (quad & 2) * 2 + (int(lane) % 2) * 2};
}

// A row's reduction over the four lanes holding its 8 columns (lanes ^1 and ^8).
inline float bda_tile_row_max(float x) {
  x = max(x, simd_shuffle_xor(x, ushort(1)));
  return max(x, simd_shuffle_xor(x, ushort(8)));
}
inline float bda_tile_row_sum(float x) {
  x += simd_shuffle_xor(x, ushort(1));
  return x + simd_shuffle_xor(x, ushort(8));
}

// Whether key `key` of a staged block of n keys, position t, counts for a row of keys `range`.
inline bool bda_tile_holds(int key, int n, int t, BdaRange range, const threadgroup int* valid) {
  return key < n && t >= range.lo && t < range.hi && valid[key] != 0;
}

// V floats into threadgroup memory.
inline void bda_put(threadgroup float* x, float v) {
  x[0] = v;
}
inline void bda_put(threadgroup float* x, float2 v) {
  x[0] = v.x;
  x[1] = v.y;
}
inline void bda_put(threadgroup float* x, float4 v) {
  x[0] = v.x;
  x[1] = v.y;
  x[2] = v.z;
  x[3] = v.w;
}

// The tiled path (bda_tiled: packed queries of many rows). The threadgroup's
// MBD_TILE_SIMDGROUPS simdgroups hold its MBD_TILE_ROWS rows (i, then g; rows
// group_first on, of one request and KV head), 8 each: simdgroup sg the rows
// of an 8 x D query tile. Blocks of MBD_TILE_BLOCK keys of the rows' joint
// interval are staged as float32 in threadgroup memory, each K/V row read once
// for all rows; a simdgroup skips an 8-key block outside its rows' keys. Per
// 8-key block: S = Q K^T and O += P V by 8 x 8 multiply-accumulate, the online
// softmax in float32 on S's elements (thread_elements: each lane holds two
// columns of one row), each score masked to its row's range as bda_attend does.
// P V multiplies every staged value by every row's weight, and a key outside a
// row's range weighs 0 there: 0 x NaN (or inf) would make the row NaN. So the
// staging notes whether a value of the block is not finite, and only such a
// block takes P V lane by lane, each row adding only the keys of its range.
// Single pass: the plan never splits it.
template <typename T, int D, typename Rows>
inline void bda_attend_tiles(
    const device T* queries,
    Rows kv,
    const device int* kv_starts,
    const device float* sinks,
    const device int* ring_offsets,
    device T* out,
    constant BatchedDecodeParams& p,
    int b,
    BdaRows own,
    BdaRequest request,
    int kv_head,
    int group_first,
    uint sg,
    uint lane) {
  constexpr int KB = MBD_TILE_BLOCK;
  constexpr int ND = D / 8;
  constexpr int V = bda_vector_width<D, D, false>();
  constexpr int NV = D / V;
  constexpr int THREADS = MBD_TILE_SIMDGROUPS * MBD_SIMD_WIDTH;
  static_assert(KB % 8 == 0 && 2 * KB >= MBD_TILE_ROWS, "whole 8-key blocks; the query tile fits the staging");
  static_assert((2 * KB * D + KB + MBD_TILE_SIMDGROUPS) * 4 + MBD_MAX_SIMDGROUPS * (D + 2 * MBD_MAX_ROWS) * 4 +
                    MBD_TILE_KEYS * 4 <= 32768,
                "the staged blocks and bda_attend's own threadgroup memory fit 32 KB");
  typedef typename bda_vec<float, V>::type floatv;
  const int tid = int(sg) * MBD_SIMD_WIDTH + int(lane);
  const int G = p.gqa_factor;
  const int total_rows = G * own.count;
  const int group_end = min(total_rows, group_first + MBD_TILE_ROWS);
  const BdaRange keys = bda_block_keys(request, own, p, group_first, group_end);

  // This lane's row of its S and O tiles (one layout for all).
  const BdaTileCoord at = bda_tile_coord(lane);
  const int f = group_first + int(sg) * 8 + at.row;
  const bool mine = f < total_rows;
  const int row_i = f / G;
  const int head = kv_head * G + f % G;
  const BdaRange range =
      mine ? bda_row_keys(request.len, request.start, own.count, row_i, p.window) : BdaRange{0, 0};
  // The simdgroup's keys: uniform bounds for skipping a block.
  const int sg_lo = simd_min(range.lo < range.hi ? range.lo : numeric_limits<int>::max());
  const int sg_hi = simd_max(range.lo < range.hi ? range.hi : 0);

  // K rows, then V rows, of a block; first the query tile [MBD_TILE_ROWS, D].
  threadgroup float bda_stage[2 * KB * D];
  threadgroup int bda_stage_valid[KB];
  threadgroup int bda_stage_nonfinite[MBD_TILE_SIMDGROUPS];
  for (int e = tid; e < MBD_TILE_ROWS * NV; e += THREADS) {
    const int r = group_first + e / NV;
    floatv x = floatv(0.0f);
    if (r < total_rows) {
      const device T* qrow = queries + b * p.q_batch_stride + (kv_head * G + r % G) * p.q_head_stride +
          (own.first + r / G) * p.q_row_stride;
      x = bda_load<T, V>::row(qrow + (e % NV) * V, bda_vector_loads) * p.scale;
    }
    bda_put(&bda_stage[e * V], x);
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);
  simdgroup_float8x8 q[ND];
  simdgroup_float8x8 o[ND];
  for (int d = 0; d < ND; ++d) {
    simdgroup_load(q[d], bda_stage, D, ulong2(8 * d, 8 * sg));
    o[d] = make_filled_simdgroup_matrix<float, 8>(0.0f);
  }
  float m = -bda_inf;
  float l = 0.0f;
  // The query tile is in registers before the first block overwrites it.
  threadgroup_barrier(mem_flags::mem_threadgroup);

  kv.seek(b, kv_head);
  const int shift = bda_ring_shift(ring_offsets, p, b);
  const float softcap = p.softcap;
  for (int tile = keys.lo; tile < keys.hi; tile += KB) {
    const int n = min(KB, keys.hi - tile);
    bool nonfinite = false;
    for (int e = tid; e < 2 * KB * NV; e += THREADS) {
      const int side = e / (KB * NV);
      const int key = e / NV % KB;
      const int vi = e % NV;
      floatv x = floatv(0.0f);
      if (key < n) {
        const BdaRow row = bda_row(kv_starts, p, b, tile + key, shift);
        if (side == 0 && vi == 0) {
          bda_stage_valid[key] = row.valid ? 1 : 0;
        }
        if (row.valid) {
          x = side == 0 ? kv.key(row, tile + key, vi) : kv.value(row, tile + key, vi);
          // x . 0 is NaN exactly when an element is NaN or inf.
          nonfinite = nonfinite || (side == 1 && isnan(bda_dot(x, floatv(0.0f))));
        }
      }
      bda_put(&bda_stage[e * V], x);
    }
    const int sg_nonfinite = simd_max(nonfinite ? 1 : 0);
    if (lane == 0) {
      bda_stage_nonfinite[sg] = sg_nonfinite;
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);
    // Uniform across the threadgroup: whether P V must keep each row to its own keys.
    bool guarded = false;
    for (int k = 0; k < MBD_TILE_SIMDGROUPS; ++k) {
      guarded = guarded || bda_stage_nonfinite[k] != 0;
    }
    for (int kb = 0; kb < n; kb += 8) {
      // Uniform across the simdgroup: a block outside all its rows' keys is neither multiplied nor weighed.
      if (tile + kb >= sg_hi || tile + kb + 8 <= sg_lo) {
        continue;
      }
      simdgroup_float8x8 s = make_filled_simdgroup_matrix<float, 8>(0.0f);
      for (int d = 0; d < ND; ++d) {
        simdgroup_float8x8 kt;
        simdgroup_load(kt, bda_stage, D, ulong2(8 * d, kb), true);
        simdgroup_multiply_accumulate(s, q[d], kt, s);
      }
      thread vec<float, 2>& scores = s.thread_elements();
      bool in[2];
      float block_max = -bda_inf;
      for (int j = 0; j < 2; ++j) {
        const int key = kb + at.col + j;
        const int t = tile + key;
        // Logit softcapping before the range and the softmax, as bda_attend.
        if (softcap > 0.0f) {
          scores[j] = softcap * precise::tanh(scores[j] / softcap);
        }
        in[j] = bda_tile_holds(key, n, t, range, bda_stage_valid);
        if (in[j]) {
          block_max = max(block_max, scores[j]);
        }
      }
      const float m_new = max(m, bda_tile_row_max(block_max));
      const float factor = bda_weight(m, m_new);
      float block_sum = 0.0f;
      for (int j = 0; j < 2; ++j) {
        scores[j] = in[j] ? bda_weight(scores[j], m_new) : 0.0f;
        block_sum += scores[j];
      }
      l = l * factor + bda_tile_row_sum(block_sum);
      m = m_new;
      for (int d = 0; d < ND; ++d) {
        o[d].thread_elements() *= factor;
      }
      if (!guarded) {
        for (int d = 0; d < ND; ++d) {
          simdgroup_float8x8 v;
          simdgroup_load(v, bda_stage + KB * D, D, ulong2(8 * d, kb));
          simdgroup_multiply_accumulate(o[d], s, v, o[d]);
        }
        continue;
      }
      // A value is NaN or inf: each lane adds its row's weights of the keys in
      // the row's range to its own elements of O. The row's 8 weights are in
      // this lane and lanes ^1, ^8 and ^9 (columns ^2, ^4 and ^6).
      for (int other = 0; other < 4; ++other) {
        const int col = at.col ^ ((other & 1) << 1) ^ ((other & 2) << 1);
        for (int j = 0; j < 2; ++j) {
          const float w = simd_shuffle_xor(scores[j], ushort((other & 1) | ((other & 2) << 2)));
          const int key = kb + col + j;
          if (bda_tile_holds(key, n, tile + key, range, bda_stage_valid)) {
            const threadgroup float* value = bda_stage + (KB + key) * D + at.col;
            for (int d = 0; d < ND; ++d) {
              o[d].thread_elements()[0] += w * value[8 * d];
              o[d].thread_elements()[1] += w * value[8 * d + 1];
            }
          }
        }
      }
    }
    // The next block overwrites this one only once every simdgroup has read it.
    threadgroup_barrier(mem_flags::mem_threadgroup);
  }

  if (mine) {
    const float sink = p.has_sinks ? sinks[head * p.sinks_stride] : -bda_inf;
    const float norm = bda_normalizer(m, l, sink);
    const bool has_keys =
        range.lo < range.hi && (m != -bda_inf || bda_holds_key(kv_starts, p, b, range.lo, range.hi));
    const int64_t out_row = bda_out_row(p, b, own, head, row_i);
    for (int d = 0; d < ND; ++d) {
      for (int j = 0; j < 2; ++j) {
        out[out_row * D + 8 * d + at.col + j] = has_keys ? T(o[d].thread_elements()[j] * norm) : T(0.0f);
      }
    }
  }
}

// bda_attend_tiles when the launch takes the tiled path (bda_tiled) and the
// kernel has it (TILES: bda_has_tiles, not the quantized rows); whether it ran.
// A class, not `if constexpr` (C++17): kernels without tiles never instantiate it.
template <bool TILES>
struct BdaTiles {
  template <typename T, int D, typename Rows>
  static bool attend(const device T*, Rows, const device int*, const device float*, const device int*, device T*,
                     constant BatchedDecodeParams&, int, BdaRows, BdaRequest, int, int, uint, uint) {
    return false;
  }
};
template <>
struct BdaTiles<true> {
  template <typename T, int D, typename Rows>
  static bool attend(const device T* queries, Rows kv, const device int* kv_starts, const device float* sinks,
                     const device int* ring_offsets, device T* out, constant BatchedDecodeParams& p, int b,
                     BdaRows own, BdaRequest request, int kv_head, int group_first, uint sg, uint lane) {
    if (!bda_tiled) {
      return false;
    }
    bda_attend_tiles<T, D>(queries, kv, kv_starts, sinks, ring_offsets, out, p, b, own, request, kv_head,
                           group_first, sg, lane);
    return true;
  }
};

// The kernel's core, whatever the row source: one threadgroup's rows over
// its split of the keys, then the simdgroups' merge and the output (or the
// split's partials). queries [B, H_q, L, D], kv (a row source above), valid_lens
// and kv_starts int32 [B] (or, paged, block_tables int32 [B, MB]: see
// BatchedDecodeParams), sinks float32 [H_q], ring_offsets int32 [B] (the
// dense layout's, when p.has_ring_offset; else null), query_starts int32
// [B + 1] (when p.has_query_starts) (all strided), out [B, H_q, L, Dv]
// contiguous ([N, H_q, Dv] packed); split-K partials float32 [out rows,
// splits] (max, sum) and [out rows, splits, Dv] (acc); requests: the ragged
// layout's table (p.ragged), else null. The dispatch serves requests
// first_request .. + num_requests - 1: the threadgroup request first_request +
// tgid.z, or, packed, that of its row block. Head dims D and DV: the exact
// ones of a fast kernel, the largest a generic kernel takes (its own are
// p.head_dim and p.value_dim).
//
// The threadgroup holds p.group_chunks row chunks of bda_rows rows; the
// simdgroups split into one set per chunk, and the num_sg / p.group_chunks
// simdgroups ("streams") of a set walk every streams-th key. With one chunk
// each simdgroup loads its keys itself; with several, the threadgroup stages
// each tile of MBD_TILE_KEYS keys in threadgroup memory (one K or V row per
// simdgroup), so that every K/V row leaves device memory once for all rows.
template <typename T, int D, int DV, bool GENERIC, bool TILES, typename Rows>
inline void bda_attend(
    const device T* queries,
    Rows kv,
    const device int* valid_lens,
    const device int* kv_starts,
    const device float* sinks,
    const device int* ring_offsets,
    const device int* query_starts,
    device T* out,
    device float* partial_acc,
    device float* partial_max,
    device float* partial_sum,
    constant BatchedDecodeParams& p,
    const device RaggedRequest* requests,
    uint3 tgid,
    int first_request,
    int num_requests,
    uint sg,
    uint lane,
    uint num_sg) {
  // V elements per vector load (scalars for a generic head dim), C loads per
  // lane and row (32 * C * V >= W, the wider of D and DV).
  constexpr int V = bda_vector_width<D, DV, GENERIC>();
  constexpr int W = D > DV ? D : DV;
  constexpr int C = (W / V + MBD_SIMD_WIDTH - 1) / MBD_SIMD_WIDTH;
  constexpr int RB = MBD_MAX_ROWS;
  constexpr int TK = MBD_TILE_KEYS;
  static_assert(D % V == 0 && DV % V == 0, "fast head dims are multiples of their vector width");
  static_assert(2 * TK <= MBD_MAX_SIMDGROUPS, "a tile's K and V rows fit the merge's rows");
  static_assert(MBD_MAX_SIMDGROUPS * (W + 2 * RB) * 4 + TK * 4 <= 32768, "threadgroup memory is at most 32 KB");
  typedef typename bda_vec<float, V>::type floatv;
  const int dim = GENERIC ? p.head_dim : D;
  const int value_dim = GENERIC ? p.value_dim : DV;
  const int nk = dim / V;
  const int nv = value_dim / V;

  const int chunk_rows = bda_rows;
  const bool vectors = bda_vector_loads;
  const float softcap = p.softcap;
  const int split = tgid.x;
  const int kv_head = tgid.y / p.row_groups;
  const int block_rows = p.group_chunks * chunk_rows;
  int b = first_request + int(tgid.z);
  int group = tgid.y % p.row_groups;
  BdaRows own = BdaRows{0, p.num_rows};
  if (p.has_query_starts) {
    if (!bda_starts_valid(query_starts, p)) {
      // Split-K leaves the zeros to the reduce.
      if (p.num_splits == 1) {
        bda_zero_block(out, p, kv_head, group, block_rows, value_dim, sg * MBD_SIMD_WIDTH + lane,
                       num_sg * MBD_SIMD_WIDTH);
      }
      return;
    }
    b = bda_block_request(query_starts, p, block_rows, group);
    group -= bda_first_block(query_starts, p, block_rows, b);
    own = bda_packed_rows(query_starts, p, b);
  }
  const int total_rows = p.gqa_factor * own.count;
  const int group_first = group * block_rows;
  // Uniform across the threadgroup: a row block past its request's rows, or one
  // of a request another dispatch serves, has nothing to do.
  if (group_first >= total_rows || b < first_request || b >= first_request + num_requests) {
    return;
  }
  const int group_end = min(total_rows, group_first + block_rows);
  const int streams = int(num_sg) / p.group_chunks;
  const int chunk = int(sg) / streams;
  const int stream = int(sg) % streams;
  const int first = group_first + chunk * chunk_rows;
  const int rows = clamp(total_rows - first, 0, chunk_rows);

  const BdaRequest request = bda_request(valid_lens, kv_starts, requests, p, b);

  // Uniform across the launch: the plan chose the tiled path from shapes.
  if (BdaTiles<TILES>::template attend<T, D>(queries, kv, kv_starts, sinks, ring_offsets, out, p, b, own, request,
                                             kv_head, group_first, sg, lane)) {
    return;
  }

  // The threadgroup's rows cover consecutive i: their key ranges join into one interval, the only keys read.
  const BdaRange block_keys = bda_block_keys(request, own, p, group_first, group_end);
  const int keys_lo = block_keys.lo;
  const int keys_hi = block_keys.hi;

  // Row r of the chunk is row i of query head h, from (i, g) index first + r.
  floatv q[RB][C];
  floatv acc[RB][C];
  float m[RB];
  float l[RB];
  int row_head[RB];
  int row_i[RB];
  int row_lo[RB];
  int row_hi[RB];
  for (int r = 0; r < RB; ++r) {
    m[r] = -bda_inf;
    l[r] = 0.0f;
    row_head[r] = row_i[r] = row_lo[r] = row_hi[r] = 0;
    for (int c = 0; c < C; ++c) {
      acc[r][c] = floatv(0.0f);
      q[r][c] = floatv(0.0f);
    }
    // r < chunk_rows is known when the pipeline is built: unused rows cost no registers.
    if (r < chunk_rows && r < rows) {
      row_i[r] = (first + r) / p.gqa_factor;
      row_head[r] = kv_head * p.gqa_factor + (first + r) % p.gqa_factor;
      const BdaRange range = bda_row_keys(request.len, request.start, own.count, row_i[r], p.window);
      row_lo[r] = range.lo;
      row_hi[r] = range.hi;
      const device T* qrow = queries + b * p.q_batch_stride + row_head[r] * p.q_head_stride +
          (own.first + row_i[r]) * p.q_row_stride;
      for (int c = 0; c < C; ++c) {
        const int vi = lane + MBD_SIMD_WIDTH * c;
        if (vi < nk) {
          q[r][c] = bda_load<T, V>::row(qrow + vi * V, vectors) * p.scale;
        }
      }
    }
  }

  // This split's share of the threadgroup's keys, counted from its first key
  // (the plan sizes splits by the most keys a threadgroup can read, not by T).
  const int num_keys = max(keys_hi - keys_lo, 0);
  const int offset = min(split * p.split_len, num_keys);
  const int begin = keys_lo + offset;
  const int end = begin + min(p.split_len, num_keys - offset);

  // Tiles of staged K rows (0 .. TK-1) and V rows (TK .. 2TK-1); after the keys, the merge's rows.
  threadgroup floatv bda_shared[MBD_MAX_SIMDGROUPS][W / V];
  threadgroup int bda_tile_valid[TK];
  const bool staged = p.group_chunks > 1;
  kv.seek(b, kv_head);
  const int shift = bda_ring_shift(ring_offsets, p, b);
  // Uniform across the threadgroup: every simdgroup reaches the tiles' barriers.
  const int tile_len = staged ? TK : end - begin;
  for (int tile = begin; tile < end; tile += tile_len) {
    const int n = min(tile_len, end - tile);
    if (staged) {
      for (int j = int(sg); j < 2 * TK; j += int(num_sg)) {
        const int key = j % TK;
        if (key >= n) {
          continue;
        }
        const BdaRow row = bda_row(kv_starts, p, b, tile + key, shift);
        if (j < TK && lane == 0) {
          bda_tile_valid[key] = row.valid ? 1 : 0;
        }
        if (!row.valid) {
          continue;
        }
        for (int c = 0; c < C; ++c) {
          const int vi = lane + MBD_SIMD_WIDTH * c;
          if (j < TK && vi < nk) {
            bda_shared[j][vi] = kv.key(row, tile + key, vi);
          } else if (j >= TK && vi < nv) {
            bda_shared[j][vi] = kv.value(row, tile + key, vi);
          }
        }
      }
      // The tile is whole before any simdgroup reads it.
      threadgroup_barrier(mem_flags::mem_threadgroup);
    }
    for (int j = stream; j < n; j += streams) {
      // Uniform across the simdgroup (one key per simdgroup): skipping keeps simd_sum whole.
      const int t = tile + j;
      const BdaRow row = staged ? BdaRow{bda_tile_valid[j] != 0, 0, 0} : bda_row(kv_starts, p, b, t, shift);
      if (!row.valid) {
        continue;
      }
      floatv k[C];
      floatv v[C];
      for (int c = 0; c < C; ++c) {
        const int vi = lane + MBD_SIMD_WIDTH * c;
        k[c] = floatv(0.0f);
        v[c] = floatv(0.0f);
        if (vi < nk) {
          if (staged) {
            k[c] = bda_shared[j][vi];
          } else {
            k[c] = kv.key(row, t, vi);
          }
        }
        if (vi < nv) {
          if (staged) {
            v[c] = bda_shared[TK + j][vi];
          } else {
            v[c] = kv.value(row, t, vi);
          }
        }
      }
      for (int r = 0; r < RB; ++r) {
        if (r < chunk_rows && r < rows) {
          float s = 0.0f;
          for (int c = 0; c < C; ++c) {
            s += bda_dot(q[r][c], k[c]);
          }
          s = simd_sum(s);
          // Logit softcapping (Gemma 2), before the range and the softmax; sink logits stay uncapped.
          if (softcap > 0.0f) {
            s = softcap * precise::tanh(s / softcap);
          }
          // Summed by every lane, used only inside the row's range: a key outside
          // it (NaN included) never touches the row.
          if (t >= row_lo[r] && t < row_hi[r]) {
            const float m_new = max(m[r], s);
            const float factor = bda_weight(m[r], m_new);
            const float prob = bda_weight(s, m_new);
            l[r] = l[r] * factor + prob;
            for (int c = 0; c < C; ++c) {
              acc[r][c] = acc[r][c] * factor + prob * v[c];
            }
            m[r] = m_new;
          }
        }
      }
    }
    if (staged) {
      // The next tile (or the merge) overwrites this one only once every simdgroup has read it.
      threadgroup_barrier(mem_flags::mem_threadgroup);
    }
  }

  // Merge the states of a chunk's simdgroups, one row at a time to bound threadgroup memory.
  threadgroup float sg_max[MBD_MAX_SIMDGROUPS][RB];
  threadgroup float sg_sum[MBD_MAX_SIMDGROUPS][RB];
  if (lane == 0) {
    for (int r = 0; r < RB; ++r) {
      sg_max[sg][r] = m[r];
      sg_sum[sg][r] = l[r];
    }
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);

  // The chunk's simdgroups are set .. set + streams - 1; the first chunk has the most rows.
  const uint set = uint(chunk * streams);
  const int group_rows = min(chunk_rows, group_end - group_first);
  for (int r = 0; r < RB; ++r) {
    // Uniform across the threadgroup, so that every simdgroup reaches the barriers; rows past a chunk's only wait.
    if (r < chunk_rows && r < group_rows) {
      const bool mine = r < rows;
      float m_max = -bda_inf;
      for (uint s = set; s < set + uint(streams); ++s) {
        m_max = max(m_max, sg_max[s][r]);
      }
      float sum = 0.0f;
      for (uint s = set; s < set + uint(streams); ++s) {
        sum += sg_sum[s][r] * bda_weight(sg_max[s][r], m_max);
      }
      const float w = bda_weight(m[r], m_max);
      for (int c = 0; c < C; ++c) {
        const int vi = lane + MBD_SIMD_WIDTH * c;
        if (vi < nv) {
          bda_shared[sg][vi] = acc[r][c] * w;
        }
      }
      threadgroup_barrier(mem_flags::mem_threadgroup);
      const int64_t out_row = bda_out_row(p, b, own, row_head[r], row_i[r]);
      const float sink = p.has_sinks && mine ? sinks[row_head[r] * p.sinks_stride] : -bda_inf;
      const float norm = bda_normalizer(m_max, sum, sink);
      const bool has_keys = row_lo[r] < row_hi[r] &&
          (m_max != -bda_inf || bda_holds_key(kv_starts, p, b, row_lo[r], row_hi[r]));
      const uint set_lane = uint(stream) * MBD_SIMD_WIDTH + lane;
      for (uint d = set_lane; mine && d < uint(value_dim); d += uint(streams) * MBD_SIMD_WIDTH) {
        float a = 0.0f;
        for (uint s = set; s < set + uint(streams); ++s) {
          a += bda_element(bda_shared[s][d / V], d % V);
        }
        if (p.num_splits == 1) {
          out[out_row * value_dim + d] = has_keys ? T(a * norm) : T(0.0f);
        } else {
          partial_acc[(out_row * p.num_splits + split) * value_dim + d] = a;
        }
      }
      if (mine && p.num_splits > 1 && set_lane == 0) {
        partial_max[out_row * p.num_splits + split] = m_max;
        partial_sum[out_row * p.num_splits + split] = sum;
      }
      // bda_shared is rewritten by the next row.
      threadgroup_barrier(mem_flags::mem_threadgroup);
    }
  }
}

// The dense kernel: keys [B, H_kv, T, D] and values [B, H_kv, T, Dv] of T,
// strided views (a ring when p.has_ring_offset: ring_offsets int32 [B]), or
// pools [NB, BS, H_kv, D] and [NB, BS, H_kv, Dv] read through block tables
// (p.block_size > 0).
template <typename T, int D, int DV, bool GENERIC>
[[kernel]] void batched_decode_attention(
    const device T* queries [[buffer(0)]],
    const device T* keys [[buffer(1)]],
    const device T* values [[buffer(2)]],
    const device int* valid_lens [[buffer(3)]],
    const device int* kv_starts [[buffer(4)]],
    const device float* sinks [[buffer(5)]],
    device T* out [[buffer(6)]],
    device float* partial_acc [[buffer(7)]],
    device float* partial_max [[buffer(8)]],
    device float* partial_sum [[buffer(9)]],
    constant BatchedDecodeParams& p [[buffer(10)]],
    const device int* ring_offsets [[buffer(11)]], // MBD_RING_OFFSETS
    const device int* query_starts [[buffer(29)]], // MBD_QUERY_STARTS
    uint3 tgid [[threadgroup_position_in_grid]],
    uint sg [[simdgroup_index_in_threadgroup]],
    uint lane [[thread_index_in_simdgroup]],
    uint num_sg [[simdgroups_per_threadgroup]]) {
  const BdaDenseRows<T, bda_vector_width<D, DV, GENERIC>()> kv{
      keys, values, p.k_head_stride, p.v_head_stride, bda_vector_loads};
  bda_attend<T, D, DV, GENERIC, bda_has_tiles<D, DV, GENERIC>()>(
      queries, kv, valid_lens, kv_starts, sinks, ring_offsets, query_starts, out, partial_acc, partial_max,
      partial_sum, p, nullptr, tgid, 0, p.num_requests, sg, lane, num_sg);
}

// The quantized kernel: keys and values as mx.quantize's (packed uint32
// [B, H_kv, T, D * BITS / 32], scales and biases [B, H_kv, T, D / group_size]
// of float16, bfloat16 or float32) triples, any strides but the words' last
// axis; values of head dim DV (MLA's latent: narrower than keys). The reduce
// pass is batched_decode_attention_reduce's.
template <typename T, int D, int DV, bool GENERIC, int BITS>
[[kernel]] void quantized_batched_decode_attention(
    const device T* queries [[buffer(0)]],
    const device uint* keys [[buffer(1)]],
    const device uint* values [[buffer(2)]],
    const device int* valid_lens [[buffer(3)]],
    const device int* kv_starts [[buffer(4)]],
    const device float* sinks [[buffer(5)]],
    device T* out [[buffer(6)]],
    device float* partial_acc [[buffer(7)]],
    device float* partial_max [[buffer(8)]],
    device float* partial_sum [[buffer(9)]],
    constant BatchedDecodeParams& p [[buffer(10)]],
    const device uchar* key_scales [[buffer(11)]],
    const device uchar* key_biases [[buffer(12)]],
    const device uchar* value_scales [[buffer(13)]],
    const device uchar* value_biases [[buffer(14)]],
    constant QuantizedDecodeParams& q [[buffer(15)]],
    const device int* query_starts [[buffer(29)]], // MBD_QUERY_STARTS
    uint3 tgid [[threadgroup_position_in_grid]],
    uint sg [[simdgroup_index_in_threadgroup]],
    uint lane [[thread_index_in_simdgroup]],
    uint num_sg [[simdgroups_per_threadgroup]]) {
  const BdaQuantizedRows<BITS, bda_vector_width<D, DV, GENERIC>()> kv{
      keys, values, key_scales, key_biases, value_scales, value_biases, p.k_batch_stride, p.k_head_stride,
      p.k_seq_stride, p.v_batch_stride, p.v_head_stride, p.v_seq_stride, &q, 0, 0};
  bda_attend<T, D, DV, GENERIC, false>(queries, kv, valid_lens, kv_starts, sinks, nullptr, query_starts, out,
                                       partial_acc, partial_max, partial_sum, p, nullptr, tgid, 0, p.num_requests, sg,
                                       lane, num_sg);
}

// The ragged kernel: request b's keys [H_kv, T_b, D] and values [H_kv, T_b, Dv] (any strides)
// in buffers of their own, one dispatch per group of requests whose buffers fit
// the MBD_RAGGED_SLOTS slots (buffers MBD_RAGGED_SLOT0 on, 13 to 28); the
// request table requests [B] says where each request's rows lie. The reduce
// pass is batched_decode_attention_reduce's, over all B.
template <typename T, int D, int DV, bool GENERIC>
[[kernel]] void ragged_decode_attention(
    const device T* queries [[buffer(0)]],
    const device int* valid_lens [[buffer(3)]],
    const device int* kv_starts [[buffer(4)]],
    const device float* sinks [[buffer(5)]],
    device T* out [[buffer(6)]],
    device float* partial_acc [[buffer(7)]],
    device float* partial_max [[buffer(8)]],
    device float* partial_sum [[buffer(9)]],
    constant BatchedDecodeParams& p [[buffer(10)]],
    const device RaggedRequest* requests [[buffer(11)]],
    constant RaggedGroupParams& group [[buffer(12)]],
    const device T* slot0 [[buffer(13)]],
    const device T* slot1 [[buffer(14)]],
    const device T* slot2 [[buffer(15)]],
    const device T* slot3 [[buffer(16)]],
    const device T* slot4 [[buffer(17)]],
    const device T* slot5 [[buffer(18)]],
    const device T* slot6 [[buffer(19)]],
    const device T* slot7 [[buffer(20)]],
    const device T* slot8 [[buffer(21)]],
    const device T* slot9 [[buffer(22)]],
    const device T* slot10 [[buffer(23)]],
    const device T* slot11 [[buffer(24)]],
    const device T* slot12 [[buffer(25)]],
    const device T* slot13 [[buffer(26)]],
    const device T* slot14 [[buffer(27)]],
    const device T* slot15 [[buffer(28)]],
    const device int* query_starts [[buffer(29)]], // MBD_QUERY_STARTS
    uint3 tgid [[threadgroup_position_in_grid]],
    uint sg [[simdgroup_index_in_threadgroup]],
    uint lane [[thread_index_in_simdgroup]],
    uint num_sg [[simdgroups_per_threadgroup]]) {
  const BdaRaggedRows<T, bda_vector_width<D, DV, GENERIC>()> kv{
      {{slot0, slot1, slot2, slot3, slot4, slot5, slot6, slot7, slot8, slot9, slot10, slot11, slot12, slot13, slot14,
        slot15}},
      requests, bda_vector_loads, nullptr, nullptr, 0, 0};
  bda_attend<T, D, DV, GENERIC, bda_has_tiles<D, DV, GENERIC>()>(
      queries, kv, valid_lens, kv_starts, sinks, nullptr, query_starts, out, partial_acc, partial_max, partial_sum, p,
      requests, tgid, group.first_request, group.num_requests, sg, lane, num_sg);
}

// Split-K second pass: merges the splits' (max, sum, acc) of one output row
// (request, query head, row i; packed: packed row, query head) with
// log-sum-exp weights, then the sink joins the denominator. Empty splits carry
// max = -inf; a row with no key gives zeros, and so does every row of
// malformed query_starts. requests: the ragged layout's table (p.ragged),
// whose lengths bound the rows' ranges as in the main pass; any buffer otherwise.
template <typename T, int D, int DV, bool GENERIC>
[[kernel]] void batched_decode_attention_reduce(
    const device int* valid_lens [[buffer(3)]],
    const device int* kv_starts [[buffer(4)]],
    const device float* sinks [[buffer(5)]],
    device T* out [[buffer(6)]],
    const device float* partial_acc [[buffer(7)]],
    const device float* partial_max [[buffer(8)]],
    const device float* partial_sum [[buffer(9)]],
    constant BatchedDecodeParams& p [[buffer(10)]],
    const device RaggedRequest* requests [[buffer(11)]],
    const device int* query_starts [[buffer(29)]], // MBD_QUERY_STARTS
    uint3 tgid [[threadgroup_position_in_grid]],
    uint tid [[thread_index_in_threadgroup]],
    uint3 group_size [[threads_per_threadgroup]]) {
  const int dim = GENERIC ? p.value_dim : DV;
  const int head = tgid.y;
  int i = tgid.x;
  int b = tgid.z;
  BdaRows own = BdaRows{0, p.num_rows};
  if (p.has_query_starts) {
    // tgid.x is a packed row.
    if (!bda_starts_valid(query_starts, p)) {
      for (uint d = tid; d < uint(dim); d += group_size.x) {
        out[(int64_t(i) * p.num_q_heads + head) * dim + d] = T(0.0f);
      }
      return;
    }
    b = bda_row_request(query_starts, p, i);
    own = bda_packed_rows(query_starts, p, b);
    i -= own.first;
  }
  const int64_t out_row = bda_out_row(p, b, own, head, i);
  const BdaRequest request = bda_request(valid_lens, kv_starts, requests, p, b);
  const BdaRange range = bda_row_keys(request.len, request.start, own.count, i, p.window);
  const device float* maxes = partial_max + out_row * p.num_splits;
  const device float* sums = partial_sum + out_row * p.num_splits;
  float m_max = -bda_inf;
  for (int s = 0; s < p.num_splits; ++s) {
    m_max = max(m_max, maxes[s]);
  }
  float sum = 0.0f;
  for (int s = 0; s < p.num_splits; ++s) {
    sum += sums[s] * bda_weight(maxes[s], m_max);
  }
  const float sink = p.has_sinks ? sinks[head * p.sinks_stride] : -bda_inf;
  const float norm = bda_normalizer(m_max, sum, sink);
  for (uint d = tid; d < uint(dim); d += group_size.x) {
    float a = 0.0f;
    for (int s = 0; s < p.num_splits; ++s) {
      a += partial_acc[(out_row * p.num_splits + s) * dim + d] * bda_weight(maxes[s], m_max);
    }
    const bool has_keys = m_max != -bda_inf || bda_holds_key(kv_starts, p, b, range.lo, range.hi);
    out[out_row * dim + d] = range.lo < range.hi && has_keys ? T(a * norm) : T(0.0f);
  }
}
