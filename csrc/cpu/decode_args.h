// Plain description of one batched decode attention call, shared by the
// scheduler and the per-instruction-set kernels (no MLX types cross here).
#pragma once

#include <cstdint>

namespace mlx_batched_decode::cpu {

enum class Dtype { float16, bfloat16, float32 };

// Dimension legend: B requests, H_q query heads, H_kv key/value heads,
// G = H_q / H_kv query heads per KV head, T padded length, D head dim.
// Strides are in elements and may be anything (views are read in place).
struct DecodeArgs {
  const void* queries; // [B, H_q, 1, D]
  const void* keys; // [B, H_kv, T, D]
  const void* values; // [B, H_kv, T, D]
  const int32_t* valid_lens; // [B], clamped to [0, T] by the kernel
  void* out; // [B, H_q, 1, D], row contiguous
  Dtype dtype;
  int B, H_q, H_kv, G, T, D;
  int64_t q_stride[3]; // batch, head, dim
  int64_t k_stride[4]; // batch, head, position, dim
  int64_t v_stride[4];
  int64_t lens_stride;
  float scale;

  int length(int b) const {
    int64_t n = valid_lens[b * lens_stride];
    return n < 0 ? 0 : (n > T ? T : static_cast<int>(n));
  }
};

// Online-softmax state of the G query heads of one (request, KV head) over a
// range of keys: running max m [G], running sum l [G] and the unnormalised
// accumulator acc [G, D], all float32, stored back to back in one float buffer.
struct PartialState {
  float* m;
  float* l;
  float* acc;

  static int64_t size(int G, int D) {
    return static_cast<int64_t>(G) * (D + 2);
  }
  static PartialState at(float* base, int G, int D) {
    return {base, base + G, base + 2 * G};
  }
};

// Keys [t0, t1) of request b, KV head h: one work item.
struct Chunk {
  int b, h, t0, t1;
};

// Attends the G query heads of c.b, c.h to keys [c.t0, c.t1) and stores the
// state. next, if not null, is the chunk this thread runs after it: its first
// rows are requested from memory while this one ends.
using ChunkFn = void (*)(const DecodeArgs&, const Chunk& c, PartialState, const Chunk* next);
// Merges the n partial states stored back to back at parts and writes the G
// output rows of (b, h); n == 0 writes zeros (empty request).
using FinalizeFn = void (*)(const DecodeArgs&, int b, int h, float* parts, int n);

struct KernelFns {
  ChunkFn chunk;
  FinalizeFn finalize;
};

} // namespace mlx_batched_decode::cpu
