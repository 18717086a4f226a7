// Entry points of the instruction-set variants of the CPU kernel.
#pragma once

#include "cpu/decode_args.h"

namespace mlx_batched_decode::cpu {

// kernel_fns returns the kernel of a head dim: its own for kFastHeadDims, else
// the generic one; quantized_kernel_fns the kernel on packed keys and values
// of `bits` (QuantizedRows), for a head dim that is a multiple of 32.
namespace baseline {
KernelFns kernel_fns(Dtype dtype, int head_dim);
KernelFns quantized_kernel_fns(Dtype dtype, int head_dim, int bits);
}
namespace avx2 {
KernelFns kernel_fns(Dtype dtype, int head_dim);
KernelFns quantized_kernel_fns(Dtype dtype, int head_dim, int bits);
}
namespace avx512bf16 {
KernelFns kernel_fns(Dtype dtype, int head_dim);
KernelFns quantized_kernel_fns(Dtype dtype, int head_dim, int bits);
}
namespace avx512fp16 {
KernelFns kernel_fns(Dtype dtype, int head_dim);
}
namespace amx {
KernelFns kernel_fns(Dtype dtype, int head_dim);
KernelFns quantized_kernel_fns(Dtype dtype, int head_dim, int bits);
}

} // namespace mlx_batched_decode::cpu
