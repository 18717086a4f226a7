// Batched decode attention: padded, length-driven, GQA read-once, split-K.
//
// Dimensions: B requests, H_q query heads, H_kv key/value heads,
// G = H_q / H_kv query heads per KV head, T cache positions, D head dim.
// One threadgroup per (split, KV head x head chunk, request). Each simdgroup
// walks its own keys; each lane owns a D-slice, so a K/V row is one vector load
// per lane and serves all G heads of the chunk. Softmax state is float32.
#pragma once

#include <metal_stdlib>

#include "batched_decode_attention_params.h"

using namespace metal;

using mlx_batched_decode::BatchedDecodeParams;

// min(G, MBD_HEADS_PER_CHUNK), fixed per pipeline so that the registers of
// heads a threadgroup never serves are compiled away.
constant int bda_heads [[function_constant(MBD_FC_HEADS)]];

// exp(m - m_max) with an empty state (m = -inf) weighing 0, never NaN.
inline float bda_weight(float m, float m_max) {
  return m == -INFINITY ? 0.0f : exp(m - m_max);
}

template <typename T, int D>
[[kernel]] void batched_decode_attention(
    const device T* queries [[buffer(0)]],
    const device T* keys [[buffer(1)]],
    const device T* values [[buffer(2)]],
    const device int* valid_lens [[buffer(3)]],
    device T* out [[buffer(4)]],
    device float* partial_acc [[buffer(5)]],
    device float* partial_max [[buffer(6)]],
    device float* partial_sum [[buffer(7)]],
    constant BatchedDecodeParams& p [[buffer(8)]],
    uint3 tgid [[threadgroup_position_in_grid]],
    uint tid [[thread_index_in_threadgroup]],
    uint sg [[simdgroup_index_in_threadgroup]],
    uint lane [[thread_index_in_simdgroup]],
    uint num_sg [[simdgroups_per_threadgroup]]) {
  // V elements per vector load, C loads per lane and row (32 * C * V >= D).
  constexpr int V = (D % 128 == 0) ? 4 : 2;
  constexpr int NV = D / V;
  constexpr int C = (NV + MBD_SIMD_WIDTH - 1) / MBD_SIMD_WIDTH;
  constexpr int GB = MBD_HEADS_PER_CHUNK;
  typedef vec<float, V> floatv;
  typedef vec<T, V> loadv;

  const int split = tgid.x;
  const int kv_head = tgid.y / p.head_chunks;
  const int chunk = tgid.y % p.head_chunks;
  const int b = tgid.z;
  const int head0 = kv_head * p.gqa_factor + chunk * GB;
  const int heads = min(GB, p.gqa_factor - chunk * GB);

  // Clamped so that no length, however wrong, reads outside [0, T).
  const int len = clamp(valid_lens[b * p.lens_stride], 0, p.seq_len);
  const int begin = split * p.split_len;
  const int end = min(begin + p.split_len, len);

  floatv q[GB][C];
  floatv acc[GB][C];
  float m[GB];
  float l[GB];
  for (int g = 0; g < GB; ++g) {
    m[g] = -INFINITY;
    l[g] = 0.0f;
    for (int c = 0; c < C; ++c) {
      const int vi = lane + MBD_SIMD_WIDTH * c;
      acc[g][c] = floatv(0.0f);
      q[g][c] = floatv(0.0f);
      if (g < bda_heads && g < heads && vi < NV) {
        const device T* qrow =
            queries + b * p.q_batch_stride + (head0 + g) * p.q_head_stride;
        q[g][c] = floatv(*(const device loadv*)(qrow + vi * V)) * p.scale;
      }
    }
  }

  const device T* kbase = keys + b * p.k_batch_stride + kv_head * p.k_head_stride;
  const device T* vbase = values + b * p.v_batch_stride + kv_head * p.v_head_stride;
  for (int t = begin + int(sg); t < end; t += int(num_sg)) {
    floatv k[C];
    floatv v[C];
    for (int c = 0; c < C; ++c) {
      const int vi = lane + MBD_SIMD_WIDTH * c;
      k[c] = floatv(0.0f);
      v[c] = floatv(0.0f);
      if (vi < NV) {
        k[c] = floatv(*(const device loadv*)(kbase + t * p.k_seq_stride + vi * V));
        v[c] = floatv(*(const device loadv*)(vbase + t * p.v_seq_stride + vi * V));
      }
    }
    for (int g = 0; g < GB; ++g) {
      if (g < bda_heads && g < heads) {
        float s = 0.0f;
        for (int c = 0; c < C; ++c) {
          s += dot(q[g][c], k[c]);
        }
        s = simd_sum(s);
        const float m_new = max(m[g], s);
        const float factor = exp(m[g] - m_new);
        const float prob = exp(s - m_new);
        l[g] = l[g] * factor + prob;
        for (int c = 0; c < C; ++c) {
          acc[g][c] = acc[g][c] * factor + prob * v[c];
        }
        m[g] = m_new;
      }
    }
  }

  // Merge the simdgroups' states, one head at a time to bound threadgroup memory.
  threadgroup float sg_max[MBD_MAX_SIMDGROUPS][GB];
  threadgroup float sg_sum[MBD_MAX_SIMDGROUPS][GB];
  threadgroup float sg_acc[MBD_MAX_SIMDGROUPS][D];
  if (lane == 0) {
    for (int g = 0; g < GB; ++g) {
      sg_max[sg][g] = m[g];
      sg_sum[sg][g] = l[g];
    }
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);

  const int row0 = b * p.num_q_heads + head0;
  for (int g = 0; g < GB; ++g) {
    if (g < bda_heads && g < heads) {
      float m_max = -INFINITY;
      for (uint s = 0; s < num_sg; ++s) {
        m_max = max(m_max, sg_max[s][g]);
      }
      float sum = 0.0f;
      for (uint s = 0; s < num_sg; ++s) {
        sum += sg_sum[s][g] * bda_weight(sg_max[s][g], m_max);
      }
      const float w = bda_weight(m[g], m_max);
      for (int c = 0; c < C; ++c) {
        const int vi = lane + MBD_SIMD_WIDTH * c;
        if (vi < NV) {
          for (int e = 0; e < V; ++e) {
            sg_acc[sg][vi * V + e] = acc[g][c][e] * w;
          }
        }
      }
      threadgroup_barrier(mem_flags::mem_threadgroup);
      const int row = row0 + g;
      for (uint d = tid; d < uint(D); d += num_sg * MBD_SIMD_WIDTH) {
        float a = 0.0f;
        for (uint s = 0; s < num_sg; ++s) {
          a += sg_acc[s][d];
        }
        if (p.num_splits == 1) {
          out[row * D + d] = T(sum > 0.0f ? a / sum : 0.0f);
        } else {
          partial_acc[(row * p.num_splits + split) * D + d] = a;
        }
      }
      if (p.num_splits > 1 && tid == 0) {
        partial_max[row * p.num_splits + split] = m_max;
        partial_sum[row * p.num_splits + split] = sum;
      }
      // sg_acc is rewritten by the next head.
      threadgroup_barrier(mem_flags::mem_threadgroup);
    }
  }
}

// Split-K second pass: merges the splits' (max, sum, acc) of one (request,
// query head) with log-sum-exp weights. Empty splits carry max = -inf.
template <typename T, int D>
[[kernel]] void batched_decode_attention_reduce(
    device T* out [[buffer(4)]],
    const device float* partial_acc [[buffer(5)]],
    const device float* partial_max [[buffer(6)]],
    const device float* partial_sum [[buffer(7)]],
    constant BatchedDecodeParams& p [[buffer(8)]],
    uint3 tgid [[threadgroup_position_in_grid]],
    uint tid [[thread_index_in_threadgroup]],
    uint3 group_size [[threads_per_threadgroup]]) {
  const int row = tgid.z * p.num_q_heads + tgid.y;
  const device float* maxes = partial_max + row * p.num_splits;
  const device float* sums = partial_sum + row * p.num_splits;
  float m_max = -INFINITY;
  for (int s = 0; s < p.num_splits; ++s) {
    m_max = max(m_max, maxes[s]);
  }
  float sum = 0.0f;
  for (int s = 0; s < p.num_splits; ++s) {
    sum += sums[s] * bda_weight(maxes[s], m_max);
  }
  for (uint d = tid; d < uint(D); d += group_size.x) {
    float a = 0.0f;
    for (int s = 0; s < p.num_splits; ++s) {
      a += partial_acc[(row * p.num_splits + s) * D + d] * bda_weight(maxes[s], m_max);
    }
    out[row * D + d] = T(sum > 0.0f ? a / sum : 0.0f);
  }
}
