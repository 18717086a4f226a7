// Runs the CPU kernel's paged row source and shared-block scheduler on random
// adversarial block tables and lengths, with every buffer an exact-size heap
// allocation: built with AddressSanitizer + UBSan by tests/kernels/cpu/test_paged_sanitizer.py,
// any read outside a pool, a table or the lengths is reported. Also checks each
// output against a scalar float64 reference of the paged contract.
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <random>
#include <vector>

#include "cpu/decode_args.h"
#include "cpu/parallel_decode.h"
#include "reference_row.h"

using namespace mlx_batched_decode::cpu;

int main() {
  std::mt19937 rng(7);
  int failures = 0;
  const int wild[] = {-1, -2, INT32_MAX, INT32_MIN, 1 << 30};
  for (int round = 0; round < 300; ++round) {
    const int bs = std::vector<int>{1, 3, 7, 8, 16, 32, 64}[rng() % 7];
    const int nb = 1 + rng() % 12, B = 1 + rng() % 8, mb = 1 + rng() % 10, L = 1 + rng() % 3;
    const int H_kv = 1 + rng() % 2, G = 1 + rng() % 4, H_q = H_kv * G, D = round % 2 ? 64 : 24;
    const int T = mb * bs, window = round % 3 == 0 ? 1 + int(rng() % (T + 2)) : T;
    std::vector<int32_t> tables(size_t(B) * mb), lens(B);
    for (auto& e : tables) {
      // Wild entries, some a pool's size above them (wrapping as int32 would).
      e = rng() % 4 == 0 ? int32_t(uint32_t(wild[rng() % 5]) + uint32_t(rng() % 2) * uint32_t(nb)) : int(rng() % nb);
    }
    for (int b = 1; b < B; ++b) {
      if (rng() % 2) {
        std::copy_n(tables.begin(), mb, tables.begin() + int64_t(b) * mb);
      }
    }
    for (auto& n : lens) {
      n = rng() % 4 == 0 ? (rng() % 2 ? INT32_MAX : INT32_MIN) : int(rng() % (T + 20)) - 5;
    }
    std::normal_distribution<float> normal;
    std::vector<float> q(size_t(B) * H_q * L * D), k(size_t(nb) * bs * H_kv * D), v(k.size());
    for (auto* a : {&q, &k, &v}) {
      for (auto& x : *a) {
        x = normal(rng);
      }
    }
    std::vector<float> out(q.size(), NAN);
    DecodeArgs a{};
    a.queries = q.data();
    a.keys = k.data();
    a.values = v.data();
    a.block_tables = tables.data();
    a.table_stride[0] = mb;
    a.table_stride[1] = 1;
    a.block_size = bs;
    a.num_blocks = nb;
    a.valid_lens = lens.data();
    a.out = out.data();
    a.dtype = Dtype::float32;
    a.B = B, a.H_q = H_q, a.H_kv = H_kv, a.G = G, a.L = L, a.T = T, a.D = D;
    a.Dp = padded_head_dim(D);
    a.same_head_dims();
    a.window = window;
    const int64_t qs[4] = {int64_t(H_q) * L * D, int64_t(L) * D, D, 1};
    const int64_t ks[4] = {int64_t(bs) * H_kv * D, D, int64_t(H_kv) * D, 1}; // {page, head, row, dim}
    for (int i = 0; i < 4; ++i) {
      a.q_stride[i] = qs[i];
      a.k_stride[i] = a.v_stride[i] = ks[i];
    }
    a.lens_stride = 1;
    a.scale = 1.0f / std::sqrt(float(D));
    run_decode(a);
    for (int b = 0; b < B; ++b) {
      const int len = lens[b] < 0 ? 0 : std::min(lens[b], T);
      for (int h = 0; h < H_q; ++h) {
        for (int i = 0; i < L; ++i) {
          for (int e = 0; e < D; e += 7) {
            const int p = len - L + i;
            const double want = reference_row(
                q.data() + ((int64_t(b) * H_q + h) * L + i) * D, std::max(0, p - window + 1), p + 1, D, e, [&](int t) {
                  const int32_t page = tables[b * mb + t / bs];
                  if (page < 0 || page >= nb) {
                    return std::pair<const float*, const float*>{nullptr, nullptr};
                  }
                  const int64_t row = ((int64_t(page) * bs + t % bs) * H_kv + h / (H_q / H_kv)) * D;
                  return std::pair<const float*, const float*>{k.data() + row, v.data() + row};
                });
            const double got = out[((int64_t(b) * H_q + h) * L + i) * D + e];
            if (!(std::fabs(got - want) < 1e-4)) {
              if (failures++ < 5) {
                std::printf("round %d b %d h %d i %d e %d: got %g want %g\n", round, b, h, i, e, got, want);
              }
            }
          }
        }
      }
    }
  }
  std::printf("%s: %d mismatches, %llu shared items\n", failures ? "FAIL" : "OK", failures,
              (unsigned long long)shared_items());
  return failures ? 1 : 0;
}
