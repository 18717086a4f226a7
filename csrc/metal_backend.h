// The Metal backend this process uses: the metallib installed next to the
// extension module, the embedded source, or none. Built on every platform.
#pragma once

#include <string>

#include "metal/backend_choice.h"

namespace mlx_batched_decode {

// Library name of the prebuilt kernels: <module dir>/mlx_batched_decode.metallib.
inline constexpr const char* kMetallibName = "mlx_batched_decode";

// The directory holding the extension module.
const std::string& module_dir();

// Decided once per process, from whether Metal is present in this build and
// at run time, and whether the metallib is on disk.
MetalBackend metal_backend();

} // namespace mlx_batched_decode
