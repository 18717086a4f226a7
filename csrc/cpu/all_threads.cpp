#include "cpu/all_threads.h"

#include <algorithm>
#include <atomic>
#include <memory>
#include <utility>

#include "cpu/parallel_decode.h"
#include "cpu/worker_pool.h"

namespace mlx_batched_decode::cpu {

namespace {

// Shared by the caller and the pool's threads; a helper that starts after the
// last piece was claimed finds none to do.
struct Pass {
  size_t pieces;
  std::function<uint64_t(size_t)> piece;
  std::atomic<size_t> next{0};
  std::atomic<size_t> done{0};
  std::atomic<uint64_t> checksum{0};

  void work() {
    uint64_t sum = 0;
    size_t finished = 0;
    for (size_t i; (i = next.fetch_add(1)) < pieces; ++finished) {
      sum ^= piece(i);
    }
    checksum.fetch_xor(sum, std::memory_order_relaxed);
    if (finished > 0 && done.fetch_add(finished, std::memory_order_acq_rel) + finished == pieces) {
      done.notify_all();
    }
  }
};

} // namespace

uint64_t run_pieces(size_t pieces, std::function<uint64_t(size_t)> piece) {
  auto pass = std::make_shared<Pass>();
  pass->pieces = pieces;
  pass->piece = std::move(piece);
  const int helpers = std::min<size_t>(max_threads() - 1, pieces > 0 ? pieces - 1 : 0);
  if (helpers > 0) {
    shared_pool().enqueue([pass] { pass->work(); }, helpers);
  }
  pass->work();
  wait_for_count(pass->done, pieces);
  return pass->checksum.load();
}

} // namespace mlx_batched_decode::cpu
