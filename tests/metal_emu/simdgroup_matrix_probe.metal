// Probe of the harness's simdgroup_load / simdgroup_store / simdgroup_multiply(_accumulate):
// MLX's steel attention loads its tiles lane by lane (thread_elements), so this
// kernel checks the whole-tile operations against MSL's documented addressing
// (elements_per_row, matrix_origin as {column, row} of the source, transpose).
#include <metal_stdlib>

using namespace metal;

// One threadgroup of 4 simdgroups, simdgroup s owning output tile (s / 2, s % 2) of 16 x 16:
// product = a [16, 16] x b [16, 16] (a from device memory, b staged transposed in threadgroup
// memory and loaded with transpose), first = a[:, :8] x b[:8, :]; both stored into [16 + 2, ld]
// outputs at origin {1, 2}, whose other elements keep what the caller put there.
template <typename T>
[[kernel]] void simdgroup_matrix_probe(
    const device T* a [[buffer(0)]],
    const device T* b [[buffer(1)]],
    device float* product [[buffer(2)]],
    device float* first [[buffer(3)]],
    constant int& ld [[buffer(4)]],
    uint simd_group [[simdgroup_index_in_threadgroup]],
    uint tid [[thread_index_in_threadgroup]]) {
  threadgroup T b_transposed[16 * 16];
  for (uint i = tid; i < 256; i += 128) {
    b_transposed[(i % 16) * 16 + i / 16] = b[i];
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);
  const ulong row = simd_group / 2 * 8;
  const ulong column = simd_group % 2 * 8;
  simdgroup_float8x8 acc = make_filled_simdgroup_matrix<float, 8>(0.0f);
  simdgroup_float8x8 head;
  for (ulong k = 0; k < 16; k += 8) {
    simdgroup_matrix<T, 8, 8> ta;
    simdgroup_matrix<T, 8, 8> tb;
    simdgroup_load(ta, a, 16, ulong2(k, row));
    simdgroup_load(tb, b_transposed, 16, ulong2(k, column), true);
    simdgroup_multiply_accumulate(acc, ta, tb, acc);
    if (k == 0) {
      simdgroup_multiply(head, ta, tb);
    }
  }
  simdgroup_store(acc, product, ulong(ld), ulong2(column + 1, row + 2));
  simdgroup_store(head, first, ulong(ld), ulong2(column + 1, row + 2));
}

template [[host_name("simdgroup_matrix_probe_float")]] [[kernel]] decltype(simdgroup_matrix_probe<float>)
    simdgroup_matrix_probe<float>;
template [[host_name("simdgroup_matrix_probe_half")]] [[kernel]] decltype(simdgroup_matrix_probe<half>)
    simdgroup_matrix_probe<half>;
