// The one way the CPU kernels request a line ahead of its use.
#pragma once

namespace mlx_batched_decode::cpu::MBD_CPU_ISA {

// Requests the cache line that holds p into L2 (prefetcht2 on x86-64, the
// instruction __builtin_prefetch(p, 0, 1) emits). With GCC on x86-64 an asm
// statement: GCC 12 splits a function at an early guard (partial inlining),
// finds a split-off part that only prefetches free of side effects and
// deletes its call: RowSource::prefetch had no prefetch left in the build
// that way. p need not point at memory: nothing is read.
inline void prefetch_l2(const void* p) {
#if defined(__GNUC__) && !defined(__clang__) && defined(__x86_64__)
  asm volatile("prefetcht2 %0" : : "m"(*static_cast<const char*>(p)));
#else
  __builtin_prefetch(p, 0, 1);
#endif
}

} // namespace mlx_batched_decode::cpu::MBD_CPU_ISA
