// Entry points of the instruction-set variants of the CPU kernel.
#pragma once

#include "cpu/decode_args.h"

namespace mlx_batched_decode::cpu {

// Each returns the kernel of a head dim: its own for kFastHeadDims, else the
// generic one.
namespace baseline {
KernelFns kernel_fns(Dtype dtype, int head_dim);
}
namespace avx2 {
KernelFns kernel_fns(Dtype dtype, int head_dim);
}
namespace avx512bf16 {
KernelFns kernel_fns(Dtype dtype, int head_dim);
}
namespace avx512fp16 {
KernelFns kernel_fns(Dtype dtype, int head_dim);
}
namespace amx {
KernelFns kernel_fns(Dtype dtype, int head_dim);
}

} // namespace mlx_batched_decode::cpu
