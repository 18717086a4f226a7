// Where the Metal kernels come from. Plain C++, so that the Linux tests check
// the choice through the emulation harness (tests/kernels/metal/test_metal_backend.py).
#pragma once

namespace mlx_batched_decode {

enum class MetalBackend { none, metallib, source };

/**
 * The kernels' origin: none without Metal; the prebuilt metallib when it is on
 * disk next to the extension (MLX throws when asked to load a missing one);
 * otherwise the embedded source, compiled at first use.
 */
inline MetalBackend choose_metal_backend(bool metal_present, bool metallib_on_disk) {
  if (!metal_present) {
    return MetalBackend::none;
  }
  return metallib_on_disk ? MetalBackend::metallib : MetalBackend::source;
}

/** "metallib", "source", or nullptr for none. */
inline const char* metal_backend_name(MetalBackend backend) {
  constexpr const char* names[] = {nullptr, "metallib", "source"};
  return names[static_cast<int>(backend)];
}

} // namespace mlx_batched_decode
