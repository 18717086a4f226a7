// The run-time Metal libraries: one per dtype and head dim, compiled from the
// embedded source (csrc/metal_source.h) at the first call that needs them.
// Plain C++, shared with the Linux emulation harness, which checks every name
// and compiles such a source.
#pragma once

#include <string>

#include "launch_plan.h"
#include "quantized_launch_plan.h"
#include "ragged_launch_plan.h"

namespace mlx_batched_decode {

/** The MSL type of a dtype, as the .metal instantiations spell it. */
inline const char* msl_type(KernelDtype dtype) {
  constexpr const char* types[] = {"half", "bfloat", "float"};
  return types[static_cast<int>(dtype)];
}

// The instantiation macro's arguments of (dtype, D, Dv) after its name ("fast(", "fast_pair(" or
// "generic("), prefix its family ("", "ragged_", "quantized_").
inline std::string instantiation_of(const char* prefix, KernelDtype dtype, int head_dim, int value_dim) {
  const bool pair = value_dim > 0 && value_dim != head_dim && is_fast_kernel(head_dim, value_dim);
  const std::string kind = pair ? "fast_pair(" : is_fast_kernel(head_dim, value_dim) ? "fast(" : "generic(";
  const std::string dims = pair ? std::to_string(head_dim) + ", " + std::to_string(value_dim)
                                : std::to_string(kernel_head_dim(head_dim, value_dim));
  return std::string("instantiate_") + prefix + kind + dtype_name(dtype) + ", " + msl_type(dtype) + ", " + dims + ")";
}

/** The .metal line instantiating the main and reduce kernels of (dtype, D, Dv; value_dim 0: Dv = D). */
inline std::string kernel_instantiation(KernelDtype dtype, int head_dim, int value_dim = 0) {
  return instantiation_of("", dtype, head_dim, value_dim);
}

/** Name of the library of (dtype, D, Dv) in MLX's cache: the source's hash, then the kernels' suffix. */
inline std::string library_name(const std::string& source_hash, KernelDtype dtype, int head_dim, int value_dim = 0) {
  return "mlx_batched_decode_" + source_hash + "_" + kernel_suffix(dtype, head_dim, value_dim);
}

/**
 * The source of that library: `source` (the whole embedded text) with its
 * instantiations replaced by the two kernels of (dtype, D), through the
 * source's MBD_KERNELS switch; the first call of a new dtype or head dim then
 * compiles two kernels, not all of them.
 */
inline std::string library_source(const std::string& source, KernelDtype dtype, int head_dim, int value_dim = 0) {
  return "#define MBD_KERNELS " + kernel_instantiation(dtype, head_dim, value_dim) + "\n" + source;
}

/** The .metal lines instantiating the quantized main kernel of (dtype, D, Dv, bits) and the reduce of (dtype, D, Dv). */
inline std::string quantized_kernel_instantiation(KernelDtype dtype, int head_dim, int value_dim, int bits) {
  const std::string main = instantiation_of("quantized_", dtype, head_dim, value_dim);
  // The quantized macros take the bits last: "...(float16, half, 576, 512)" -> "..., 576, 512, 4)".
  return kernel_instantiation(dtype, head_dim, value_dim) + " " + main.substr(0, main.size() - 1) + ", " +
      std::to_string(bits) + ")";
}

/** Name of the run-time library of the quantized kernel of (dtype, D, Dv, bits). */
inline std::string quantized_library_name(const std::string& source_hash, KernelDtype dtype, int head_dim,
                                          int value_dim, int bits) {
  return "mlx_batched_decode_" + source_hash + "_quantized_" + kernel_suffix(dtype, head_dim, value_dim) + "_" +
      std::to_string(bits) + "bit";
}

/** The source of that library, as library_source. */
inline std::string quantized_library_source(const std::string& source, KernelDtype dtype, int head_dim,
                                            int value_dim, int bits) {
  return "#define MBD_KERNELS " + quantized_kernel_instantiation(dtype, head_dim, value_dim, bits) + "\n" + source;
}

/** The .metal lines instantiating the ragged main kernel of (dtype, D, Dv) and the reduce of (dtype, D, Dv). */
inline std::string ragged_kernel_instantiation(KernelDtype dtype, int head_dim, int value_dim = 0) {
  return kernel_instantiation(dtype, head_dim, value_dim) + " " + instantiation_of("ragged_", dtype, head_dim, value_dim);
}

/** Name of the run-time library of the ragged kernel of (dtype, D, Dv). */
inline std::string ragged_library_name(const std::string& source_hash, KernelDtype dtype, int head_dim,
                                       int value_dim = 0) {
  return "mlx_batched_decode_" + source_hash + "_ragged_" + kernel_suffix(dtype, head_dim, value_dim);
}

/** The source of that library, as library_source. */
inline std::string ragged_library_source(const std::string& source, KernelDtype dtype, int head_dim,
                                         int value_dim = 0) {
  return "#define MBD_KERNELS " + ragged_kernel_instantiation(dtype, head_dim, value_dim) + "\n" + source;
}

} // namespace mlx_batched_decode
