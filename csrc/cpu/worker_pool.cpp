#include "cpu/worker_pool.h"

#include <cstdlib>
#include <stdexcept>
#include <string>

namespace mlx_batched_decode::cpu {

namespace {

constexpr int64_t kDefaultSpinUs = 5000;
constexpr int64_t kMaxSpinUs = 10'000'000;

std::chrono::microseconds parse_spin() {
  const char* text = std::getenv("MBD_CPU_SPIN_US");
  if (text == nullptr || *text == '\0') {
    return std::chrono::microseconds(kDefaultSpinUs);
  }
  char* end = nullptr;
  const long long us = std::strtoll(text, &end, 10);
  if (*end != '\0' || us < 0 || us > kMaxSpinUs) {
    throw std::invalid_argument(
        "MBD_CPU_SPIN_US must be an integer number of microseconds in [0, " + std::to_string(kMaxSpinUs) +
        "], got '" + text + "'");
  }
  return std::chrono::microseconds(us);
}

} // namespace

std::chrono::microseconds spin_time() {
  static const std::chrono::microseconds spin = parse_spin();
  return spin;
}

WorkerPool::WorkerPool(int threads, std::chrono::microseconds spin) : spin_(spin) {
  for (int i = 0; i < threads; ++i) {
    std::thread([this] { work(); }).detach();
  }
}

void WorkerPool::enqueue(const std::function<void()>& task, int copies) {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    tasks_.insert(tasks_.end(), copies, task);
  }
  posted_.fetch_add(1, std::memory_order_release);
  posted_.notify_all();
}

bool WorkerPool::run_one() {
  std::function<void()> task;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (tasks_.empty()) {
      return false;
    }
    task = std::move(tasks_.front());
    tasks_.pop_front();
  }
  task();
  return true;
}

void WorkerPool::work() {
  for (;;) {
    // Read before looking at the queue, so an enqueue after the look changes it.
    const uint64_t seen = posted_.load(std::memory_order_acquire);
    if (run_one()) {
      continue;
    }
    if (!poll_for(spin_, [&] { return posted_.load(std::memory_order_acquire) != seen; })) {
      posted_.wait(seen, std::memory_order_acquire);
    }
  }
}

} // namespace mlx_batched_decode::cpu
