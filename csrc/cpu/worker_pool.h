// The threads that serve the CPU kernel's calls beside the calling thread.
//
// A worker that runs out of tasks keeps polling for the next one for a while
// before it sleeps. A decode step calls the kernel once per layer, and a
// worker that sleeps can be slow to start again: on the development VM, one
// woken after 20 ms idle was queued behind the waking thread on that thread's
// core and started at the next scheduler tick, 3.9 ms later. That is longer
// than a whole call at B=8, which the calling thread then ran alone.
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <deque>
#include <functional>
#include <mutex>
#include <thread>

namespace mlx_batched_decode::cpu {

// How long a worker with nothing to do polls before it sleeps: the
// environment variable MBD_CPU_SPIN_US in microseconds (0: sleep at once),
// else 5 ms. Read once; throws std::invalid_argument if it is not an integer
// in [0, 10^7].
std::chrono::microseconds spin_time();

// Polls ready() until it is true or `spin` has passed, giving the core to any
// other runnable thread between polls; returns ready()'s last value.
template <typename Ready>
bool poll_for(std::chrono::microseconds spin, Ready&& ready) {
  if (ready()) {
    return true;
  }
  const auto deadline = std::chrono::steady_clock::now() + spin;
  while (std::chrono::steady_clock::now() < deadline) {
    std::this_thread::yield();
    if (ready()) {
      return true;
    }
  }
  return false;
}

// Returns once `done` reaches n: polls for spin_time() (the last pieces of
// shared work end within one piece's time of the caller's), then sleeps on it.
template <typename Count>
void wait_for_count(const std::atomic<Count>& done, Count n) {
  poll_for(spin_time(), [&] { return done.load(std::memory_order_acquire) == n; });
  for (Count d; (d = done.load(std::memory_order_acquire)) < n;) {
    done.wait(d, std::memory_order_acquire);
  }
}

class WorkerPool {
 public:
  // Starts `threads` workers that poll for `spin` before they sleep.
  WorkerPool(int threads, std::chrono::microseconds spin);

  // Queues `copies` runs of task, each picked up by the first free worker.
  void enqueue(const std::function<void()>& task, int copies);

 private:
  void work();
  bool run_one();

  const std::chrono::microseconds spin_;
  std::mutex mutex_;
  std::deque<std::function<void()>> tasks_;
  // Bumped on every enqueue: what the idle workers poll and sleep on.
  std::atomic<uint64_t> posted_{0};
};

} // namespace mlx_batched_decode::cpu
