// Runs the CPU kernel's ragged row source (one buffer per request) on random
// adversarial lengths and starts, with every request's keys and values an
// exact-size heap allocation of its own, head-major or token-major: built with
// AddressSanitizer + UBSan by tests/kernels/cpu/test_ragged_sanitizer.py, any
// read outside a request's buffer is reported. Also checks each output
// against a scalar float64 reference of the ragged contract.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <memory>
#include <random>
#include <vector>

#include "cpu/decode_args.h"
#include "cpu/parallel_decode.h"
#include "reference_row.h"

using namespace mlx_batched_decode::cpu;

namespace {

// One request's keys and values, H_kv heads of T_b positions, and its strides.
struct Request {
  std::unique_ptr<float[]> k, v;
  int64_t stride[4];
  int T_b;
};

// An adversarial position for a request of T_b keys: wild, past T_b, negative or in range.
int32_t position(std::mt19937& rng, int T_b) {
  switch (rng() % 5) {
    case 0:
      return rng() % 2 ? INT32_MAX : INT32_MIN;
    case 1:
      return T_b + 1 + int(rng() % 50);
    case 2:
      return -1 - int(rng() % 5);
    default:
      return int(rng() % (T_b + 1));
  }
}

} // namespace

int main() {
  std::mt19937 rng(11);
  int failures = 0;
  for (int round = 0; round < 300; ++round) {
    const int B = 1 + rng() % 8, L = 1 + rng() % 3;
    const int H_kv = 1 + rng() % 2, G = 1 + rng() % 4, H_q = H_kv * G, D = round % 2 ? 64 : 24;
    std::vector<Request> requests(B);
    std::vector<RequestRows> rows(B);
    std::vector<int32_t> lens(B), starts(B);
    std::normal_distribution<float> normal;
    int T = 0;
    for (int b = 0; b < B; ++b) {
      Request& r = requests[b];
      r.T_b = rng() % 4 == 0 ? 0 : int(rng() % 70);
      const int64_t n = int64_t(H_kv) * r.T_b * D;
      r.k.reset(new float[n]);
      r.v.reset(new float[n]);
      for (int64_t j = 0; j < n; ++j) {
        r.k[j] = normal(rng);
        r.v[j] = normal(rng);
      }
      const bool token_major = rng() % 2;
      const int64_t head = token_major ? D : int64_t(r.T_b) * D, pos = token_major ? int64_t(H_kv) * D : D;
      const int64_t stride[4] = {0, head, pos, 1};
      std::copy_n(stride, 4, r.stride);
      rows[b] = {r.k.get(), r.v.get(), {}, {}, r.T_b};
      std::copy_n(stride, 4, rows[b].k_stride);
      std::copy_n(stride, 4, rows[b].v_stride);
      lens[b] = position(rng, r.T_b);
      starts[b] = position(rng, r.T_b);
      T = std::max(T, r.T_b);
    }
    const bool has_starts = rng() % 2;
    const int window = round % 3 == 0 ? 1 + int(rng() % (T + 2)) : std::max(T, 1);
    std::vector<float> q(size_t(B) * H_q * L * D), out(q.size(), NAN);
    for (auto& x : q) {
      x = normal(rng);
    }
    DecodeArgs a{};
    a.queries = q.data();
    a.requests = rows.data();
    a.valid_lens = lens.data();
    a.kv_starts = has_starts ? starts.data() : nullptr;
    a.out = out.data();
    a.dtype = Dtype::float32;
    a.B = B, a.H_q = H_q, a.H_kv = H_kv, a.G = G, a.L = L, a.T = T, a.D = D;
    a.Dp = padded_head_dim(D);
    a.same_head_dims();
    a.window = std::min(window, std::max(T, 1));
    const int64_t qs[4] = {int64_t(H_q) * L * D, int64_t(L) * D, D, 1};
    std::copy_n(qs, 4, a.q_stride);
    a.lens_stride = a.starts_stride = 1;
    a.scale = 1.0f / std::sqrt(float(D));
    run_decode(a);
    for (int b = 0; b < B; ++b) {
      const Request& r = requests[b];
      const int len = std::clamp(lens[b], 0, r.T_b);
      const int start = has_starts ? std::clamp(starts[b], 0, T) : 0;
      for (int h = 0; h < H_q; ++h) {
        for (int i = 0; i < L; ++i) {
          const int p = len - L + i, lo = std::max({start, p - a.window + 1, 0}), hi = p + 1;
          const int64_t q_row = ((int64_t(b) * H_q + h) * L + i) * D;
          for (int e = 0; e < D; e += 7) {
            const int64_t head = (h / G) * r.stride[1];
            const double want = reference_row(q.data() + q_row, lo, hi, D, e, [&](int t) {
              const int64_t row = head + t * r.stride[2];
              return std::pair<const float*, const float*>{r.k.get() + row, r.v.get() + row};
            });
            const double got = out[q_row + e];
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
  std::printf("%s: %d mismatches\n", failures ? "FAIL" : "OK", failures);
  return failures ? 1 : 0;
}
