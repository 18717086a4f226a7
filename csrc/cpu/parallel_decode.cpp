#include "cpu/parallel_decode.h"

#include <algorithm>
#include <atomic>
#include <memory>
#include <thread>
#include <vector>

#if defined(__linux__)
#include <sched.h>
#endif

#include "cpu/isa.h"
#include "cpu/worker_pool.h"

namespace mlx_batched_decode::cpu {

namespace {

// Keys per work item: long requests are split (flash-decoding) so that one
// request or a skewed batch still spreads over all cores.
constexpr int kChunk = 512;
// Below this many K/V elements in all, waking pool threads costs more than it saves.
constexpr int64_t kMinParallelElements = int64_t{1} << 17;

std::atomic<uint64_t> g_calls{0};
std::atomic<uint64_t> g_tile_blocks{0};

int cpu_count() {
#if defined(__linux__)
  // Respects affinity masks and container CPU sets, unlike hardware_concurrency.
  cpu_set_t set;
  if (sched_getaffinity(0, sizeof(set), &set) == 0) {
    return std::max(1, CPU_COUNT(&set));
  }
#endif
  return std::max(1u, std::thread::hardware_concurrency());
}

struct Item {
  Chunk chunk;
  int64_t pair; // index of (b, h) in parts_begin / remaining
  int part; // index of the chunk among its pair's
};

struct Call {
  DecodeArgs args;
  KernelFns fns;
  std::vector<Item> items;
  std::vector<int64_t> parts_begin; // [pairs + 1], prefix sum of chunk counts
  std::vector<float> parts; // partial states, PartialState::size(rows, Dp) each
  std::unique_ptr<std::atomic<int>[]> remaining; // chunks left per pair
  std::atomic<int> next{0};
  std::atomic<int> done{0};

  void process(const Item& it, const Item* following) {
    const Chunk& c = it.chunk;
    const int64_t first = parts_begin[it.pair];
    const int n = static_cast<int>(parts_begin[it.pair + 1] - first);
    const int64_t part_size = PartialState::size(args.rows(), args.Dp);
    float* base = parts.data() + first * part_size;
    if (n == 0) {
      fns.finalize(args, c.b, c.h, nullptr, 0);
      return;
    }
    fns.chunk(args, c, PartialState::at(base + it.part * part_size, args.rows()),
              following ? &following->chunk : nullptr);
    // The last chunk of a pair to finish merges them; acq_rel makes the other
    // chunks' partial states visible to it.
    if (remaining[it.pair].fetch_sub(1, std::memory_order_acq_rel) == 1) {
      fns.finalize(args, c.b, c.h, base, n);
    }
  }

  void work() {
    const int n = static_cast<int>(items.size());
    for (int i = next.fetch_add(1); i < n;) {
      // The following item is claimed before this one runs, so that its first
      // rows arrive while this one ends: short items would otherwise start cold.
      const int j = next.fetch_add(1);
      process(items[i], j < n ? &items[j] : nullptr);
      if (done.fetch_add(1, std::memory_order_acq_rel) + 1 == n) {
        done.notify_all();
      }
      i = j;
    }
  }
};

std::shared_ptr<Call> plan(const DecodeArgs& a) {
  auto call = std::make_shared<Call>();
  call->args = a;
  call->fns = a.quant.bits ? quantized_kernel_fns(a.dtype, a.D, a.quant.bits) : kernel_fns(a.dtype, a.D);
  const int64_t pairs = static_cast<int64_t>(a.B) * a.H_kv;
  call->parts_begin.resize(pairs + 1);
  call->remaining = std::make_unique<std::atomic<int>[]>(pairs);
  int64_t total = 0;
  for (int b = 0; b < a.B; ++b) {
    // Only the keys some query row attends are read: a window or a start skips the rest.
    const KeyRange keys = a.request_range(b);
    const int n = std::max(0, keys.hi - keys.lo);
    const int chunks = (n + kChunk - 1) / kChunk;
    for (int h = 0; h < a.H_kv; ++h) {
      const int64_t pair = static_cast<int64_t>(b) * a.H_kv + h;
      call->parts_begin[pair] = total;
      call->remaining[pair].store(chunks, std::memory_order_relaxed);
      total += chunks;
      if (chunks == 0) {
        call->items.push_back({{b, h, 0, 0}, pair, 0});
      }
      for (int c = 0; c < chunks; ++c) {
        const int t0 = keys.lo + c * kChunk;
        call->items.push_back({{b, h, t0, std::min(keys.hi, t0 + kChunk)}, pair, c});
      }
    }
  }
  call->parts_begin[pairs] = total;
  call->parts.resize(total * PartialState::size(a.rows(), a.Dp));
  return call;
}

} // namespace

// One pool for all calls and streams, so concurrent callers share a bounded
// number of threads; never destroyed (its workers are detached), so exit does
// not wait on it.
WorkerPool& shared_pool() {
  static WorkerPool* p = new WorkerPool(max_threads() - 1, spin_time());
  return *p;
}

int max_threads() {
  static const int n = cpu_count();
  return n;
}

uint64_t kernel_calls() {
  return g_calls.load();
}

uint64_t tile_blocks() {
  return g_tile_blocks.load();
}

void count_tile_blocks(uint64_t n) {
  g_tile_blocks.fetch_add(n, std::memory_order_relaxed);
}

void run_decode(const DecodeArgs& args) {
  g_calls.fetch_add(1);
  auto call = plan(args);
  const int n_items = static_cast<int>(call->items.size());
  if (n_items == 0) {
    return;
  }

  // K/V elements read, times the rows that use each: the arithmetic grows with L.
  int64_t elements = 0;
  for (const Item& it : call->items) {
    elements += static_cast<int64_t>(it.chunk.t1 - it.chunk.t0) * args.D * args.L;
  }
  const int helpers = elements < kMinParallelElements
      ? 0
      : std::min(max_threads() - 1, n_items - 1);
  if (helpers > 0) {
    shared_pool().enqueue([call] { call->work(); }, helpers);
  }
  call->work();
  // The helpers' last items end within one item's time of ours: poll for
  // them before sleeping, as the workers poll for calls (see worker_pool.h).
  poll_for(spin_time(), [&] { return call->done.load(std::memory_order_acquire) == n_items; });
  for (int d; (d = call->done.load(std::memory_order_acquire)) < n_items;) {
    call->done.wait(d, std::memory_order_acquire);
  }
}

} // namespace mlx_batched_decode::cpu
