// Entry points of the instruction-set variants of the CPU kernel.
#pragma once

#include "cpu/decode_args.h"

namespace mlx_batched_decode::cpu {

// The kernels a variant compiles: the dense-row kernels (dense and paged
// sources) of some dtypes, maybe the quantized ones, and kernels of their own
// for the fast head dims or only the generic one. isa.cpp sends every other
// call to the variant that serves it, so a variant compiles only what runs
// (each instantiation costs build time).
struct Compiled {
  bool float16, bfloat16, float32, quantized;
  bool fast_head_dims = true;

  constexpr bool dense(Dtype dtype) const {
    return dtype == Dtype::float16 ? float16 : dtype == Dtype::bfloat16 ? bfloat16 : float32;
  }
};

// kernel_fns returns the kernel of a head dim: its own for kFastHeadDims, else
// the generic one; quantized_kernel_fns the kernel on packed keys and values
// of `bits` (QuantizedRows), for a head dim that is a multiple of 32. Both
// give null functions for what the variant does not compile.
#define MBD_DECLARE_CPU_VARIANT(isa, ...)                                \
  namespace isa {                                                        \
  inline constexpr Compiled kCompiled{__VA_ARGS__};                      \
  KernelFns kernel_fns(Dtype dtype, int head_dim);                       \
  KernelFns quantized_kernel_fns(Dtype dtype, int head_dim, int bits);   \
  }

// The portable build and AVX2 serve everything on the CPUs they are best for.
// On x86-64 the portable build serves only CPUs without AVX2 (some Atom,
// Celeron and Pentium Silver parts): the generic head-dim kernel, an eighth of
// the build; on arm64 it is the NEON kernel of every CPU, with every head dim.
#if defined(__x86_64__) || defined(_M_X64)
MBD_DECLARE_CPU_VARIANT(baseline, true, true, true, true, false)
#else
MBD_DECLARE_CPU_VARIANT(baseline, true, true, true, true, true)
#endif
MBD_DECLARE_CPU_VARIANT(avx2, true, true, true, true)
// AVX2 with AVX-VNNI: its quantized kernels only; the dense ones are AVX2's.
MBD_DECLARE_CPU_VARIANT(avxvnni, false, false, false, true)
// Its dense kernels run on 16 lanes (bfloat16 keys on the dot product); its
// quantized kernels serve every AVX-512 variant: AVX-512VL's 32 registers let
// a score tile read 4 packed keys instead of 2.
MBD_DECLARE_CPU_VARIANT(avx512bf16, true, true, true, true)
// Its build holds the AMX variant's tile path too (where the compiler has
// AMX), taken only when that variant is selected; the rest of the two is one.
MBD_DECLARE_CPU_VARIANT(avx512fp16, true, true, true, false)

#undef MBD_DECLARE_CPU_VARIANT

} // namespace mlx_batched_decode::cpu
