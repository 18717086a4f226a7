#include "cpu/bandwidth_probe.h"

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <set>
#include <sstream>
#include <stdexcept>
#include <utility>

#if defined(__linux__)
#include <sys/mman.h>
#ifndef MADV_COLLAPSE
#define MADV_COLLAPSE 25 // linux/mman.h since 6.1; older glibc headers lack it
#endif
#endif

#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#endif

#include "cpu/all_threads.h"

namespace mlx_batched_decode::cpu {

namespace {

constexpr size_t kHugePage = size_t{2} << 20;
// A piece is what one thread claims at a time (as the kernel claims work
// items, so a descheduled thread's share is taken by the others); it is read
// as kStreams sub-ranges in parallel, as the kernel reads K and V rows of
// several heads at once, so the hardware prefetcher runs several streams.
constexpr size_t kPiece = size_t{4} << 20;
constexpr size_t kStreams = 4;
constexpr size_t kStream = kPiece / kStreams;

// ----------------------------------------------------------------- readers
// Each reads the piece at p as kStreams streams of kStream bytes, two 64-byte
// lines of each per step, and folds them into a checksum.

uint64_t read_baseline(const char* p) {
  uint64_t acc[kStreams] = {};
  for (size_t i = 0; i < kStream; i += 64) {
    for (size_t s = 0; s < kStreams; ++s) {
      const auto* line = reinterpret_cast<const uint64_t*>(p + s * kStream + i);
      for (int w = 0; w < 8; ++w) {
        acc[s] ^= line[w];
      }
    }
  }
  return acc[0] ^ acc[1] ^ acc[2] ^ acc[3];
}

#if defined(__x86_64__) || defined(_M_X64)
__attribute__((target("avx2"))) uint64_t read_avx2(const char* p) {
  __m256i acc[kStreams][2];
  for (auto& a : acc) {
    a[0] = a[1] = _mm256_setzero_si256();
  }
  for (size_t i = 0; i < kStream; i += 128) {
    for (size_t s = 0; s < kStreams; ++s) {
      const auto* v = reinterpret_cast<const __m256i*>(p + s * kStream + i);
      acc[s][0] = _mm256_xor_si256(acc[s][0], _mm256_xor_si256(_mm256_load_si256(v), _mm256_load_si256(v + 2)));
      acc[s][1] = _mm256_xor_si256(acc[s][1], _mm256_xor_si256(_mm256_load_si256(v + 1), _mm256_load_si256(v + 3)));
    }
  }
  __m256i all = _mm256_setzero_si256();
  for (auto& a : acc) {
    all = _mm256_xor_si256(all, _mm256_xor_si256(a[0], a[1]));
  }
  alignas(32) uint64_t lanes[4];
  _mm256_store_si256(reinterpret_cast<__m256i*>(lanes), all);
  return lanes[0] ^ lanes[1] ^ lanes[2] ^ lanes[3];
}

__attribute__((target("avx512f"))) uint64_t read_avx512(const char* p) {
  __m512i acc[kStreams][2];
  for (auto& a : acc) {
    a[0] = a[1] = _mm512_setzero_si512();
  }
  for (size_t i = 0; i < kStream; i += 128) {
    for (size_t s = 0; s < kStreams; ++s) {
      const auto* v = reinterpret_cast<const __m512i*>(p + s * kStream + i);
      acc[s][0] = _mm512_xor_si512(acc[s][0], _mm512_load_si512(v));
      acc[s][1] = _mm512_xor_si512(acc[s][1], _mm512_load_si512(v + 1));
    }
  }
  __m512i all = _mm512_setzero_si512();
  for (auto& a : acc) {
    all = _mm512_xor_si512(all, _mm512_xor_si512(a[0], a[1]));
  }
  alignas(64) uint64_t lanes[8];
  _mm512_store_si512(lanes, all);
  return lanes[0] ^ lanes[1] ^ lanes[2] ^ lanes[3] ^ lanes[4] ^ lanes[5] ^ lanes[6] ^ lanes[7];
}
#endif

using Reader = uint64_t (*)(const char*);

// The reader named `isa` (empty: the widest this CPU runs).
std::pair<std::string, Reader> pick_reader(const std::string& isa) {
#if defined(__x86_64__) || defined(_M_X64)
  const bool avx2 = __builtin_cpu_supports("avx2");
  const bool avx512 = __builtin_cpu_supports("avx512f");
  if ((isa.empty() && avx512) || (isa == "avx512" && avx512)) {
    return {"avx512", read_avx512};
  }
  if ((isa.empty() && avx2) || (isa == "avx2" && avx2)) {
    return {"avx2", read_avx2};
  }
#endif
  if (isa.empty() || isa == "baseline") {
    return {"baseline", read_baseline};
  }
  throw std::invalid_argument("[ReadProbe] loads '" + isa + "' are not available on this machine");
}

// Word i of the buffer holds i, so a read that loads every word once has a
// checksum (their XOR) that tests can compute.
void fill(char* data, size_t bytes) {
  auto* words = reinterpret_cast<uint64_t*>(data);
  for (size_t i = 0; i < bytes / 8; ++i) {
    words[i] = i;
  }
}

// Highest-level data or unified cache of one CPU directory: (level, bytes, sharing CPUs).
struct CacheInfo {
  int level = 0;
  size_t bytes = 0;
  std::string shared;
};

size_t parse_size(const std::string& text) {
  // sysfs writes "491520K"; accept K, M, G or a bare number of bytes.
  std::istringstream in(text);
  size_t n = 0;
  char unit = 0;
  if (!(in >> n)) {
    return 0;
  }
  in >> unit;
  switch (unit) {
    case 'K':
      return n << 10;
    case 'M':
      return n << 20;
    case 'G':
      return n << 30;
    default:
      return n;
  }
}

std::string read_line(const std::filesystem::path& path) {
  std::ifstream in(path);
  std::string line;
  std::getline(in, line);
  return line;
}

CacheInfo last_cache_of(const std::filesystem::path& cache_dir) {
  CacheInfo best;
  std::error_code ec;
  for (const auto& entry : std::filesystem::directory_iterator(cache_dir, ec)) {
    if (entry.path().filename().string().rfind("index", 0) != 0) {
      continue;
    }
    const std::string type = read_line(entry.path() / "type");
    const int level = std::atoi(read_line(entry.path() / "level").c_str());
    const size_t bytes = parse_size(read_line(entry.path() / "size"));
    if (type == "Instruction" || bytes == 0 || level < best.level) {
      continue;
    }
    best = {level, bytes, read_line(entry.path() / "shared_cpu_list")};
  }
  return best;
}

} // namespace

size_t last_level_cache_bytes(const std::string& cpu_root) {
  std::error_code ec;
  int level = 0;
  std::set<std::string> seen; // one entry per cache instance at `level`
  size_t total = 0;
  for (const auto& entry : std::filesystem::directory_iterator(cpu_root, ec)) {
    const std::string name = entry.path().filename().string();
    if (name.size() < 4 || name.rfind("cpu", 0) != 0 ||
        name.find_first_not_of("0123456789", 3) != std::string::npos) {
      continue;
    }
    const CacheInfo c = last_cache_of(entry.path() / "cache");
    if (c.level == 0 || c.level < level) {
      continue;
    }
    if (c.level > level) {
      level = c.level;
      seen.clear();
      total = 0;
    }
    // A cache without shared_cpu_list is counted once per CPU directory.
    if (seen.insert(c.shared.empty() ? name : c.shared).second) {
      total += c.bytes;
    }
  }
  return total > 0 ? total : kFallbackLlcBytes;
}

ReadProbe::ReadProbe(size_t bytes, bool huge_pages, const std::string& isa) {
  std::tie(isa_, reader_) = pick_reader(isa);
  bytes_ = std::max<size_t>(1, (bytes + kPiece - 1) / kPiece) * kPiece;
  static_assert(kPiece % kHugePage == 0, "whole pieces are whole huge pages");
#if defined(__linux__)
  // One extra huge page, so that the buffer can start on a huge-page boundary.
  mapped_ = bytes_ + kHugePage;
  void* m = mmap(nullptr, mapped_, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (m == MAP_FAILED) {
    throw std::bad_alloc();
  }
  base_ = static_cast<char*>(m);
  data_ = reinterpret_cast<char*>((reinterpret_cast<uintptr_t>(m) + kHugePage - 1) / kHugePage * kHugePage);
  // Advice before the first touch, so the faults themselves take the page
  // size; MADV_COLLAPSE then moves what the faults left on 4 KiB pages.
  madvise(data_, bytes_, huge_pages ? MADV_HUGEPAGE : MADV_NOHUGEPAGE);
  fill(data_, bytes_);
  if (huge_pages) {
    madvise(data_, bytes_, MADV_COLLAPSE);
  }
#else
  data_ = static_cast<char*>(std::aligned_alloc(kHugePage, bytes_));
  if (data_ == nullptr) {
    throw std::bad_alloc();
  }
  base_ = data_;
  fill(data_, bytes_);
#endif
}

ReadProbe::~ReadProbe() {
#if defined(__linux__)
  munmap(base_, mapped_);
#else
  std::free(base_);
#endif
}

double ReadProbe::read() {
  const char* data = data_;
  const Reader reader = reader_;
  const auto start = std::chrono::steady_clock::now();
  checksum_ = run_pieces(bytes_ / kPiece, [data, reader](size_t i) { return reader(data + i * kPiece); });
  const auto stop = std::chrono::steady_clock::now();
  return std::chrono::duration<double>(stop - start).count();
}

size_t ReadProbe::huge_page_bytes() const {
#if defined(__linux__)
  // AnonHugePages of every mapping that overlaps the buffer, capped at its
  // size (a neighbouring mapping of the same flags may have merged with it).
  std::ifstream smaps("/proc/self/smaps");
  const auto lo = reinterpret_cast<uintptr_t>(data_), hi = lo + bytes_;
  bool overlaps = false;
  size_t total = 0;
  for (std::string line; std::getline(smaps, line);) {
    uintptr_t start = 0, end = 0;
    char dash = 0;
    std::istringstream in(line);
    if (line.find("AnonHugePages:") == 0) {
      if (overlaps) {
        std::string key;
        size_t kb = 0;
        in >> key >> kb;
        total += kb << 10;
      }
    } else if (in >> std::hex >> start >> dash >> end && dash == '-') {
      overlaps = start < hi && lo < end;
    }
  }
  return std::min(total, bytes_);
#else
  return 0;
#endif
}

} // namespace mlx_batched_decode::cpu
