// Work decomposition and thread-pool scheduling of the CPU kernel.
#pragma once

#include <cstdint>

#include "cpu/decode_args.h"

namespace mlx_batched_decode::cpu {

// Computes one call synchronously on the calling thread plus the shared pool.
// Work items are (request, KV head, chunk of at most kChunk keys) over the
// keys some query row of the request attends, built from the actual lengths,
// starts and window, so the work is proportional to the keys read, not B * T.
void run_decode(const DecodeArgs& args);

// Number of run_decode calls so far: lets tests prove the fused kernel ran.
uint64_t kernel_calls();

// Blocks of keys computed on AMX tiles so far, and how the kernel adds to it
// (once per work item): lets tests prove the tile path ran.
uint64_t tile_blocks();
void count_tile_blocks(uint64_t n);

// Threads that serve one call: the pool's plus the caller.
int max_threads();

// The pool of max_threads() - 1 workers that serves every call (and the
// bandwidth probe, so that it reads on the kernel's threads).
class WorkerPool;
WorkerPool& shared_pool();

} // namespace mlx_batched_decode::cpu
