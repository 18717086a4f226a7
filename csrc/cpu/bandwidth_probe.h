// The machine's read bandwidth, measured the way the CPU kernel reads: on the
// kernel's own worker pool, with vector loads, over a buffer far larger than
// the last-level cache. Benchmarks time it in turns with the kernel, so that
// "fraction of read bandwidth" compares two readers in the same seconds.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

namespace mlx_batched_decode::cpu {

// The last-level cache size assumed where the OS does not report one.
inline constexpr size_t kFallbackLlcBytes = size_t{256} << 20;

// Bytes of last-level cache in the machine: the highest-level data or unified
// cache of cpu_root/cpu*/cache/index*/ (sysfs), each instance counted once
// (instances told apart by shared_cpu_list, so a CPU with one L3 per core
// complex counts all of them). kFallbackLlcBytes where none is reported.
size_t last_level_cache_bytes(const std::string& cpu_root = "/sys/devices/system/cpu");

// A buffer of `bytes` (rounded up to whole 4 MiB), allocated and written once,
// that read() streams through on all of the kernel's threads.
class ReadProbe {
 public:
  // huge_pages: back the buffer with transparent huge pages (Linux), else
  // keep it on 4 KiB pages. isa: "avx512", "avx2" or "baseline" loads, empty
  // for the widest this CPU supports; throws std::invalid_argument for one it
  // does not.
  ReadProbe(size_t bytes, bool huge_pages, const std::string& isa = "");
  ~ReadProbe();
  ReadProbe(const ReadProbe&) = delete;
  ReadProbe& operator=(const ReadProbe&) = delete;

  // Reads every byte of the buffer once; returns the seconds it took.
  double read();

  size_t bytes() const {
    return bytes_;
  }
  // Bytes of the buffer the OS put on huge pages (from /proc/self/smaps).
  size_t huge_page_bytes() const;
  const std::string& isa() const {
    return isa_;
  }
  // XOR of the 64-bit words the last read loaded; word i holds i. It keeps
  // the loads from being optimised away and lets tests see every word read.
  uint64_t checksum() const {
    return checksum_;
  }

 private:
  char* base_ = nullptr; // the allocation, data_ its huge-page-aligned start
  char* data_ = nullptr;
  size_t bytes_ = 0;
  size_t mapped_ = 0;
  std::string isa_;
  uint64_t (*reader_)(const char*) = nullptr;
  uint64_t checksum_ = 0;
};

} // namespace mlx_batched_decode::cpu
