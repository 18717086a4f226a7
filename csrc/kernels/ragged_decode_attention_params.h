// Arguments of the ragged decode attention kernel (one buffer per request)
// beyond BatchedDecodeParams, shared by the Metal kernel, the host launcher and
// the Linux emulation harness. Includes nothing, as batched_decode_attention_params.h.
#ifndef MLX_BATCHED_DECODE_RAGGED_PARAMS_H
#define MLX_BATCHED_DECODE_RAGGED_PARAMS_H

// Buffer indices past BatchedDecodeParams (10). The request table is bound in
// both passes (the reduce reads each request's length); a group's buffers take
// MBD_RAGGED_SLOTS indices from MBD_RAGGED_SLOT0 (Metal has 31: 0 to 30).
#define MBD_RAGGED_REQUESTS 11
#define MBD_RAGGED_GROUP 12
#define MBD_RAGGED_SLOT0 13
#define MBD_RAGGED_SLOTS 16

namespace mlx_batched_decode {

// Where request b's keys and values live: slot k_slot (v_slot) of its group's
// buffers, from element k_offset (v_offset) of that buffer, with strides in
// elements; length is its T_b, which bounds every position it reads.
struct RaggedRequest {
  int64_t k_offset;
  int64_t v_offset;
  int64_t k_head_stride;
  int64_t k_seq_stride;
  int64_t v_head_stride;
  int64_t v_seq_stride;
  int k_slot;
  int v_slot;
  int length;
};

// One dispatch of the main pass: requests first_request .. first_request +
// num_requests - 1, one per threadgroup z (packed queries: the threadgroups of
// the row blocks of these requests; the others return).
struct RaggedGroupParams {
  int first_request;
  int num_requests;
};

} // namespace mlx_batched_decode

#endif
