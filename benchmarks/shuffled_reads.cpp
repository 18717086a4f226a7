// The machine's read rate when the bytes of a paged pool are read page by
// page in a shuffled order, against the same bytes in order: the memory floor
// of a paged call whose block ids an allocator handed out after some churn.
// No kernel: each thread sums 64-byte lines with vector loads, optionally
// requesting the page `ahead` pages on first (as the kernel requests its
// successors). The buffer is at least 256 MiB and 3x the LLC. Pages of 2 KiB
// are one position of Llama-3-8B heads in a block-1 pool (H_kv 8 x D 128 x
// float16), 32 KiB one block-16 page.
//
//   g++ -O2 -mavx2 -pthread benchmarks/shuffled_reads.cpp -o /tmp/shuffled_reads
//   /tmp/shuffled_reads benchmarks/results/shuffled_reads.json
#include <immintrin.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <numeric>
#include <random>
#include <string>
#include <thread>
#include <vector>

namespace {

constexpr int kRounds = 15;

// The last-level cache in bytes (sysfs), 0 when it cannot be read.
size_t llc_bytes() {
  size_t best = 0;
  for (int index = 0; index < 8; ++index) {
    const std::string path = "/sys/devices/system/cpu/cpu0/cache/index" + std::to_string(index) + "/size";
    std::ifstream in(path);
    std::string text;
    if (!(in >> text) || text.empty()) {
      continue;
    }
    const char unit = text.back();
    const size_t scale = unit == 'K' ? size_t{1} << 10 : unit == 'M' ? size_t{1} << 20 : 1;
    best = std::max(best, static_cast<size_t>(std::stoull(text)) * scale);
  }
  return best;
}

struct Row {
  size_t page;
  bool shuffled;
  int threads, ahead;
  double gbs;
};

// Best GB/s over kRounds reads of buf in pages of `page` bytes, in `order`.
double read_rate(const char* buf, size_t bytes, size_t page, const std::vector<size_t>& order, int threads, int ahead) {
  double best = 0.0;
  for (int round = 0; round < kRounds; ++round) {
    std::vector<std::thread> pool;
    std::vector<float> sums(threads);
    const auto start = std::chrono::steady_clock::now();
    for (int th = 0; th < threads; ++th) {
      pool.emplace_back([&, th] {
        __m256 acc = _mm256_setzero_ps();
        const size_t lo = order.size() * th / threads, hi = order.size() * (th + 1) / threads;
        for (size_t i = lo; i < hi; ++i) {
          if (ahead > 0 && i + ahead < hi) {
            const char* next = buf + order[i + ahead] * page;
            for (size_t o = 0; o < page; o += 64) {
              __builtin_prefetch(next + o, 0, 1);
            }
          }
          const char* p = buf + order[i] * page;
          for (size_t o = 0; o < page; o += 64) {
            acc = _mm256_add_ps(acc, _mm256_load_ps(reinterpret_cast<const float*>(p + o)));
          }
        }
        alignas(32) float lanes[8];
        _mm256_store_ps(lanes, acc);
        sums[th] = lanes[0];
      });
    }
    for (auto& t : pool) {
      t.join();
    }
    // The sums are used, so the loads are not optimised away.
    volatile float sink = std::accumulate(sums.begin(), sums.end(), 0.0f);
    (void)sink;
    const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    best = std::max(best, bytes / seconds / 1e9);
  }
  return best;
}

} // namespace

int main(int argc, char** argv) {
  const char* out = argc > 1 ? argv[1] : "benchmarks/results/shuffled_reads.json";
  // At least 256 MiB and 3x the LLC, so no page is still cached from the round before.
  const size_t bytes = std::max(size_t{256} << 20, (3 * llc_bytes() + (size_t{1} << 20) - 1) >> 20 << 20);
  char* buf = static_cast<char*>(std::aligned_alloc(4096, bytes));
  std::memset(buf, 1, bytes);
  std::vector<Row> rows;
  for (size_t page : {size_t{2048}, size_t{32768}}) {
    std::vector<size_t> in_order(bytes / page);
    std::iota(in_order.begin(), in_order.end(), 0);
    std::vector<size_t> shuffled = in_order;
    std::shuffle(shuffled.begin(), shuffled.end(), std::mt19937(1));
    for (int threads : {1, 2}) {
      rows.push_back({page, false, threads, 0, read_rate(buf, bytes, page, in_order, threads, 0)});
      for (int ahead : {0, 1, 4, 8}) {
        rows.push_back({page, true, threads, ahead, read_rate(buf, bytes, page, shuffled, threads, ahead)});
      }
    }
  }
  std::printf("%8s  %-9s  %7s  %11s  %6s\n", "page", "order", "threads", "pages ahead", "GB/s");
  FILE* json = std::fopen(out, "w");
  if (json == nullptr) {
    std::perror(out);
    return 1;
  }
  std::fprintf(json, "{\"bytes\": %zu, \"llc_bytes\": %zu, \"rows\": [\n", bytes, llc_bytes());
  for (size_t i = 0; i < rows.size(); ++i) {
    const Row& r = rows[i];
    std::printf("%8zu  %-9s  %7d  %11d  %6.1f\n", r.page, r.shuffled ? "shuffled" : "in order", r.threads, r.ahead, r.gbs);
    std::fprintf(json, "  {\"page\": %zu, \"shuffled\": %s, \"threads\": %d, \"ahead\": %d, \"gbs\": %.2f}%s\n", r.page,
                 r.shuffled ? "true" : "false", r.threads, r.ahead, r.gbs, i + 1 < rows.size() ? "," : "");
  }
  std::fprintf(json, "]}\n");
  std::fclose(json);
  std::printf("saved %s\n", out);
  std::free(buf);
}
