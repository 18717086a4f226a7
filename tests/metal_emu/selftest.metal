// Kernels that exercise the harness itself: every emulated collective and
// built-in, on threadgroups with a partial last simdgroup.
#include <metal_stdlib>

using namespace metal;

// Each thread writes 12 values: 6 collectives, 4 built-ins, 2 threadgroup memory reads.
template <typename T>
[[kernel]] void collectives(
    device float* out [[buffer(0)]],
    constant int& rotate [[buffer(1)]],
    uint3 tg_pos [[threadgroup_position_in_grid]],
    uint3 grid_pos [[thread_position_in_grid]],
    uint3 tg_size [[threads_per_threadgroup]],
    uint tid [[thread_index_in_threadgroup]],
    uint sg [[simdgroup_index_in_threadgroup]],
    uint lane [[thread_index_in_simdgroup]],
    uint num_sg [[simdgroups_per_threadgroup]]) {
  const T x = T(float(tid) + 0.5f);
  device float* o = out + (tg_pos.x * tg_size.x + tid) * 12;
  o[0] = float(simd_sum(x));
  o[1] = float(simd_max(x));
  o[2] = float(simd_min(x));
  o[3] = float(simd_shuffle_xor(x, ushort(1)));
  o[4] = float(simd_broadcast(x, ushort(3)));
  o[5] = float(simd_shuffle(x, ushort((lane + rotate) % 32)));
  o[6] = float(grid_pos.x);
  o[7] = float(sg);
  o[8] = float(lane);
  o[9] = float(num_sg);
  // Reversal through threadgroup memory needs the barrier.
  threadgroup float shared[64];
  shared[tid] = float(x);
  threadgroup_barrier(mem_flags::mem_threadgroup);
  o[10] = shared[tg_size.x - 1 - tid];
  simdgroup_barrier(mem_flags::mem_none);
  o[11] = shared[tid];
}

template [[host_name("collectives_float")]] [[kernel]] decltype(collectives<float>) collectives<float>;
template [[host_name("collectives_half")]] [[kernel]] decltype(collectives<half>) collectives<half>;

constant int selftest_offset [[function_constant(3)]];

// out[tid] = the function constant + tid.
template <typename T>
[[kernel]] void read_constant(device T* out [[buffer(0)]], uint tid [[thread_index_in_threadgroup]]) {
  out[tid] = T(selftest_offset) + T(tid);
}

template [[host_name("read_constant_int")]] [[kernel]] decltype(read_constant<int>) read_constant<int>;
