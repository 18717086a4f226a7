// Transparent huge pages for long-lived buffers such as KV caches.
#pragma once

#include <cstddef>

#include <mlx/array.h>

namespace mlx_batched_decode {

// Moves the huge-page-aligned interior of an evaluated array's memory onto
// transparent huge pages (Linux; a no-op elsewhere) and returns how many bytes
// now sit on them: 0 when the kernel has none to give or the array is smaller
// than one huge page. Contents are kept. Throws std::invalid_argument for an
// array that is not evaluated.
size_t advise_huge_pages(const mlx::core::array& a);

} // namespace mlx_batched_decode
