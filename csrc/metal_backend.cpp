#include "metal_backend.h"

#include <dlfcn.h>

#include <filesystem>
#include <stdexcept>

#include "mlx/backend/metal/metal.h"

namespace mlx_batched_decode {

const std::string& module_dir() {
  static const std::string dir = [] {
    Dl_info info;
    if (!dladdr(reinterpret_cast<void*>(&module_dir), &info)) {
      throw std::runtime_error("[batched_decode_attention] cannot locate the extension module on disk");
    }
    return std::filesystem::path(info.dli_fname).parent_path().string();
  }();
  return dir;
}

MetalBackend metal_backend() {
  // Once: every pipeline of the process then comes from one library.
  static const MetalBackend backend = [] {
#if defined(MLX_BATCHED_DECODE_METAL)
    const bool metal = mlx::core::metal::is_available();
#else
    const bool metal = false;
#endif
    const std::filesystem::path metallib =
        std::filesystem::path(module_dir()) / (std::string(kMetallibName) + ".metallib");
    return choose_metal_backend(metal, std::filesystem::is_regular_file(metallib));
  }();
  return backend;
}

} // namespace mlx_batched_decode
