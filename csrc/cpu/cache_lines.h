// Buffers that start on a cache line. The kernels' scratch is read and written
// 64 bytes at a time (AVX-512 vectors, AMX tile rows of 64 bytes); malloc
// aligns to 16, and a 64-byte access across two lines costs two. On the AMX
// path a block's scores (tile loads and products) took 2.3x as long from
// malloc's scratch.
#pragma once

#include <cstddef>
#include <memory>
#include <new>
#include <vector>

namespace mlx_batched_decode::cpu {

inline constexpr std::size_t kCacheLine = 64;

template <typename E>
struct CacheLineAllocator {
  using value_type = E;

  CacheLineAllocator() = default;
  template <typename U>
  CacheLineAllocator(const CacheLineAllocator<U>&) {}

  E* allocate(std::size_t n) {
    return static_cast<E*>(::operator new(n * sizeof(E), std::align_val_t{kCacheLine}));
  }
  void deallocate(E* p, std::size_t) {
    ::operator delete(p, std::align_val_t{kCacheLine});
  }
  template <typename U>
  bool operator==(const CacheLineAllocator<U>&) const {
    return true;
  }
};

// A std::vector whose data starts on a cache line.
template <typename E>
using LineVector = std::vector<E, CacheLineAllocator<E>>;

struct LineArrayDelete {
  template <typename E>
  void operator()(E* p) const {
    ::operator delete[](p, std::align_val_t{kCacheLine});
  }
};

// An array of n trivially constructible E on a cache line, left uninitialised.
template <typename E>
using LineArray = std::unique_ptr<E[], LineArrayDelete>;

template <typename E>
LineArray<E> make_line_array(std::size_t n) {
  return LineArray<E>(new (std::align_val_t{kCacheLine}) E[n]);
}

} // namespace mlx_batched_decode::cpu
