// Arguments of the batched decode attention kernels, shared by the Metal
// kernels, the host launcher and the Linux emulation harness: one layout for all.
// As MLX's kernel parameter headers, it includes nothing: host code includes
// <cstdint> first, and the Metal source embedded in _ext has only <metal_stdlib>.
#ifndef MLX_BATCHED_DECODE_PARAMS_H
#define MLX_BATCHED_DECODE_PARAMS_H

// Compile-time limits of the kernels, also read by the launch plan.
#define MBD_SIMD_WIDTH 32
#define MBD_MAX_SIMDGROUPS 8
// Query rows one simdgroup holds at most; each K/V row it reads serves them all.
#define MBD_MAX_ROWS 8
// Keys of a K/V tile in threadgroup memory, which the simdgroups of several
// row chunks share: its K and V rows take the merge's MBD_MAX_SIMDGROUPS rows.
#define MBD_TILE_KEYS (MBD_MAX_SIMDGROUPS / 2)
// The tiled path (packed queries of many rows): a threadgroup of MBD_TILE_SIMDGROUPS
// simdgroups holds MBD_TILE_ROWS query rows, 8 per simdgroup (an 8 x 8
// simdgroup matrix's rows), and stages MBD_TILE_BLOCK keys at a time.
#define MBD_TILE_SIMDGROUPS 4
#define MBD_TILE_ROWS (8 * MBD_TILE_SIMDGROUPS)
#define MBD_TILE_BLOCK 16
// The widest head dim of the tiled path (D = Dv, a multiple of 8).
#define MBD_TILE_MAX_DIM 128
// Function constant indices: the query rows one threadgroup holds (<= MBD_MAX_ROWS),
// whether Q/K/V rows allow whole vector loads (bool), and whether the kernel
// takes the tiled path (bool).
#define MBD_FC_ROWS 0
#define MBD_FC_VECTOR_LOADS 1
#define MBD_FC_TILED 2
// The dense kernel's ring offsets int32 [B] (has_ring_offset); the index is
// free in that kernel (the quantized and ragged kernels bind their own there).
#define MBD_RING_OFFSETS 11
// Packed queries' query_starts int32 [B + 1] (has_query_starts), in every main
// kernel and the reduce: past the ragged kernel's last slot (28), Metal's 31 buffers.
#define MBD_QUERY_STARTS 29

namespace mlx_batched_decode {

// Dimensions: B requests, H_q query heads, H_kv KV heads, G = H_q / H_kv,
// L query rows per request, T cache positions, D head dim of queries and keys,
// Dv of values and the output.
// Strides are in elements; the last axis of every tensor is contiguous.
struct BatchedDecodeParams {
  int64_t q_batch_stride;
  int64_t q_head_stride;
  int64_t q_row_stride;
  int64_t k_batch_stride;
  int64_t k_head_stride;
  int64_t k_seq_stride;
  int64_t v_batch_stride;
  int64_t v_head_stride;
  int64_t v_seq_stride;
  int64_t lens_stride;    // valid_lens may be a strided or broadcast view
  int64_t starts_stride;  // kv_starts, when has_kv_starts
  int64_t sinks_stride;   // sinks, when has_sinks
  int num_q_heads;   // H_q
  int gqa_factor;    // G = H_q / H_kv
  int num_rows;      // L (packed queries: N, all requests' rows)
  int head_dim;      // D (the generic kernels' loop bound of queries and keys)
  int row_groups;    // threadgroups per (request, KV head), along the grid's y
  int group_chunks;  // row chunks (of MBD_FC_ROWS rows) per threadgroup, one per simdgroup set
  int seq_len;       // T, the bound every position is clamped to
  int window;        // keys a row attends at most, in [1, max(T, 1)]
  int num_splits;    // sequence chunks of split-K; 1 = single pass
  int split_len;     // keys per split
  int has_kv_starts; // 0: every request starts at key 0, kv_starts is not read
  int has_sinks;     // 0: no sink logit, sinks is not read
  // 1: the ragged layout: buffer MBD_RAGGED_REQUESTS holds a RaggedRequest per
  // request, whose own length bounds its positions (k/v strides are unused).
  int ragged;
  float scale;
  float softcap;  // 0: none; else each score s becomes softcap * tanh(s / softcap)
  // Paged layout (block_size > 0): keys and values are pools [NB, BS, H_kv, D],
  // k/v_batch_stride step pages and k/v_seq_stride rows of a page, and buffer
  // kv_starts holds block_tables int32 [B, MB] (has_kv_starts is 0). Position
  // t of request b is row t % BS of page block_tables[b, t / BS]; a page
  // outside [0, NB) holds no key and is never read.
  int block_size;          // BS; 0: the dense layout
  int num_blocks;          // NB
  int64_t table_batch_stride;
  int64_t table_page_stride;
  // Ring (dense layout only): position t of request b lives in slot
  // (t + ring_offsets[b]) mod T; the kernel takes the modulo itself.
  int has_ring_offset;
  int64_t ring_stride;
  int value_dim;  // Dv (the generic kernels' loop bound of values and the output)
  int num_requests; // B
  // Packed queries (has_query_starts): request b has rows query_starts[b] ..
  // query_starts[b + 1] - 1 of the N = num_rows, queries are the view
  // [B, H_q, N, D] of batch stride 0, the output [N, H_q, Dv], and row_groups
  // counts row blocks per KV head, which the kernel maps to requests.
  int has_query_starts;
  int64_t query_starts_stride;
};

} // namespace mlx_batched_decode

#endif
