// Streaming a KV cache from 4 KiB pages costs a TLB miss and a hardware
// prefetcher restart every few rows; from 2 MiB pages the kernel reads a
// cache 1.07-1.37x faster (benchmarks/bench_pages.py; README, "Pages").
// MLX's CPU allocator takes plain malloc memory, so the pages are asked for
// after the fact: MADV_HUGEPAGE keeps later faults and khugepaged on huge
// pages, and MADV_COLLAPSE (Linux 6.1+) moves the present pages at once.
#include "huge_pages.h"

#include <cstdint>
#include <fstream>
#include <stdexcept>

#if defined(__linux__)
#include <sys/mman.h>
#ifndef MADV_COLLAPSE
#define MADV_COLLAPSE 25  // linux/mman.h since 6.1; older glibc headers lack it
#endif
#endif

namespace mlx_batched_decode {

namespace {

// The size of a transparent huge page, 0 when the kernel has none.
size_t huge_page_size() {
  static const size_t size = [] {
    size_t bytes = 0;
    std::ifstream("/sys/kernel/mm/transparent_hugepage/hpage_pmd_size") >> bytes;
    return bytes;
  }();
  return size;
}

} // namespace

size_t advise_huge_pages(const mlx::core::array& a) {
  if (!a.is_available()) {
    throw std::invalid_argument("[advise_huge_pages] evaluate the array first (mx.eval).");
  }
#if defined(__linux__)
  const uintptr_t page = huge_page_size();
  if (page == 0 || a.data_size() == 0) {
    return 0;
  }
  const auto begin = reinterpret_cast<uintptr_t>(a.data<char>());
  const uintptr_t first = (begin + page - 1) / page * page;
  const uintptr_t last = (begin + a.data_size() * a.itemsize()) / page * page;
  if (last <= first) {
    return 0;
  }
  auto* start = reinterpret_cast<void*>(first);
  const size_t length = last - first;
  // Both are advice: a refusal (THP off, no free huge pages, an old kernel)
  // leaves the memory as it was, so the answer is the only thing that changes.
  if (madvise(start, length, MADV_HUGEPAGE) != 0 || madvise(start, length, MADV_COLLAPSE) != 0) {
    return 0;
  }
  return length;
#else
  return 0;
#endif
}

} // namespace mlx_batched_decode
