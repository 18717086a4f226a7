// Run-time choice between the instruction-set variants of the CPU kernel.
#pragma once

#include <string>
#include <vector>

#include "cpu/decode_args.h"

namespace mlx_batched_decode::cpu {

// Linux hands out AMX tile state only to processes that ask for it: asks
// once and says whether it was granted (the grant covers every thread).
bool amx_permitted();

// Variants compiled in, whatever the CPU, best last.
std::vector<std::string> built_isas();

// Variants compiled in and supported by this CPU, best last.
std::vector<std::string> available_isas();

// The variant in use: the best available unless overridden by set_isa.
std::string current_isa();

// Selects a variant by name; throws std::invalid_argument if unavailable.
void set_isa(const std::string& name);

// Whether the variant in use is AMX's: the AVX512-FP16 kernels with their
// tile path allowed (DecodeArgs::amx_tiles).
bool tiles_selected();

// The kernel of the current variant for dtype and head dim.
KernelFns kernel_fns(Dtype dtype, int head_dim);
// The same for packed keys and values of `bits` (4 or 8).
KernelFns quantized_kernel_fns(Dtype dtype, int head_dim, int bits);

} // namespace mlx_batched_decode::cpu
