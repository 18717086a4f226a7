// Decode attention over paged key/value caches (block tables):
// batched_decode_attention's semantics on pools of fixed-size blocks, the
// layout of vLLM and SGLang.
//
// Dimension legend: B requests, H_q query heads, H_kv key/value heads
// (G = H_q / H_kv), L query rows per request, D head dim, NB blocks in the
// pool, BS rows per block (block_size), MB table entries per request
// (max_blocks), T = MB * BS logical positions.
#pragma once

#include "decode_options.h"
#include "mlx/array.h"
#include "mlx/utils.h"

namespace mlx_batched_decode {

// Attention of the last L tokens of each request over its paged keys.
//   queries      [B, H_q, L, D]      float16 | bfloat16 | float32
//   key_pages    [NB, BS, H_kv, D]   same dtype; any strides, read in place
//   value_pages  [NB, BS, H_kv, D]   same dtype and shape
//   block_tables [B, MB]             int32: position j of request b is row
//                                    j % BS of block block_tables[b, j / BS]
//   valid_lens   [B]                 integer; len_b = clamp(valid_lens[b], 0, T)
//   options      scale, window, sinks as batched_decode_attention; no kv_starts
// Table entries at or past len_b are never read; an entry inside len_b that
// lies outside [0, NB) is never dereferenced and its block holds no key.
// Returns [B, H_q, L, D] in the queries' dtype; a row with no key gives zeros.
// Malformed arguments throw std::invalid_argument (ValueError in Python).
mx::array paged_decode_attention(const mx::array& queries, const mx::array& key_pages, const mx::array& value_pages,
                                 const mx::array& block_tables, const mx::array& valid_lens,
                                 const DecodeOptions& options = {}, mx::StreamOrDevice s = {});

// The same contract in plain MLX ops (gather the pages, mask, float32
// softmax): ground truth for tests and the primitive's fallback.
mx::array reference_paged_attention(const mx::array& queries, const mx::array& key_pages,
                                    const mx::array& value_pages, const mx::array& block_tables,
                                    const mx::array& valid_lens, const DecodeOptions& options = {},
                                    mx::StreamOrDevice s = {});

} // namespace mlx_batched_decode
