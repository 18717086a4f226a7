// One pass of measured work spread over all of the CPU kernel's threads, as
// the kernel spreads a call: the probes time their reads and multiply-adds
// this way, so that they run on the same threads as the kernel they rate.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>

namespace mlx_batched_decode::cpu {

// Runs piece(i) once for every i in [0, pieces) on the caller and the shared
// pool's workers, each thread claiming the next piece when it finishes one
// (so a descheduled thread's share is taken by the others), and returns when
// all have run: the XOR of what the pieces returned.
uint64_t run_pieces(size_t pieces, std::function<uint64_t(size_t)> piece);

} // namespace mlx_batched_decode::cpu
