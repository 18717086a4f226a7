// The Metal kernels as one self-contained source string, on every platform:
// csrc/kernels/*.metal with their includes resolved, generated at build time
// by cmake/metal_source.py. The metallib is built from the same text, and
// eval_gpu compiles it at first use where there is no metallib.
#pragma once

namespace mlx_batched_decode {

// The source: ASCII, including nothing but <metal_stdlib>.
const char* metal_source();

// 16 hex digits of the source's SHA-256; run-time library names carry it, so
// that two different sources never share an entry of MLX's library cache.
const char* metal_source_hash();

} // namespace mlx_batched_decode
