// Runs the CPU kernel's ring row source (ring_offset) on random adversarial
// offsets (wild, negative, past T), lengths and starts, with the keys and
// values one exact-size heap allocation each, head-major or token-major:
// built with AddressSanitizer + UBSan by tests/kernels/cpu/test_ring_sanitizer.py,
// any read outside the ring is reported. Also checks each output against a
// scalar float64 reference that reads the ring in time order.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <random>
#include <vector>

#include "cpu/decode_args.h"
#include "cpu/parallel_decode.h"
#include "reference_row.h"

using namespace mlx_batched_decode::cpu;

namespace {

int32_t wild(std::mt19937& rng, int T) {
  switch (rng() % 5) {
    case 0:
      return rng() % 2 ? INT32_MAX : INT32_MIN;
    case 1:
      return T + int(rng() % (3 * T + 1));
    case 2:
      return -1 - int(rng() % (2 * T + 1));
    default:
      return int(rng() % (T + 1));
  }
}

} // namespace

int main() {
  std::mt19937 rng(5);
  int failures = 0;
  for (int round = 0; round < 300; ++round) {
    // Lengths past a work item's 512 keys in some rounds, so rings wrap inside a request's chunks.
    const int B = 1 + rng() % 6, L = 1 + rng() % 3, T = round % 5 == 0 ? 600 + int(rng() % 500) : int(rng() % 80);
    const int H_kv = 1 + rng() % 2, G = 1 + rng() % 3, H_q = H_kv * G, D = round % 2 ? 64 : 24;
    std::vector<int32_t> lens(B), starts(B), offsets(B);
    for (int b = 0; b < B; ++b) {
      lens[b] = rng() % 3 ? int(rng() % (T + 1)) : wild(rng, T);
      starts[b] = wild(rng, T);
      offsets[b] = wild(rng, T);
    }
    const bool has_starts = rng() % 2, token_major = rng() % 2;
    const int window = round % 3 == 0 ? 1 + int(rng() % (T + 2)) : std::max(T, 1);
    std::normal_distribution<float> normal;
    std::vector<float> q(size_t(B) * H_q * L * D), k(size_t(B) * H_kv * T * D), v(k.size()), out(q.size(), NAN);
    for (auto* a : {&q, &k, &v}) {
      for (auto& x : *a) {
        x = normal(rng);
      }
    }
    DecodeArgs a{};
    a.queries = q.data();
    a.keys = k.data();
    a.values = v.data();
    a.valid_lens = lens.data();
    a.kv_starts = has_starts ? starts.data() : nullptr;
    a.ring_offsets = offsets.data();
    a.out = out.data();
    a.dtype = Dtype::float32;
    a.B = B, a.H_q = H_q, a.H_kv = H_kv, a.G = G, a.L = L, a.T = T, a.D = D;
    a.Dp = padded_head_dim(D);
    a.same_head_dims();
    a.window = std::min(window, std::max(T, 1));
    const int64_t qs[4] = {int64_t(H_q) * L * D, int64_t(L) * D, D, 1};
    const int64_t ks[4] = {int64_t(H_kv) * T * D, token_major ? D : int64_t(T) * D, token_major ? int64_t(H_kv) * D : D, 1};
    std::copy_n(qs, 4, a.q_stride);
    std::copy_n(ks, 4, a.k_stride);
    std::copy_n(ks, 4, a.v_stride);
    a.lens_stride = a.starts_stride = a.ring_stride = 1;
    a.scale = 1.0f / std::sqrt(float(D));
    run_decode(a);
    for (int b = 0; b < B; ++b) {
      const int len = std::clamp(lens[b], 0, T), start = has_starts ? std::clamp(starts[b], 0, T) : 0;
      const int64_t shift = T > 0 ? ((int64_t(offsets[b]) % T) + T) % T : 0;
      auto slot = [&](int t) { return (t + shift) % T; };
      for (int h = 0; h < H_q; ++h) {
        for (int i = 0; i < L; ++i) {
          const int p = len - L + i, lo = std::max({start, p - a.window + 1, 0}), hi = p + 1;
          const int64_t q_row = ((int64_t(b) * H_q + h) * L + i) * D;
          for (int e = 0; e < D; e += 7) {
            const double want = reference_row(q.data() + q_row, lo, hi, D, e, [&](int t) {
              const int64_t row = b * ks[0] + (h / G) * ks[1] + slot(t) * ks[2];
              return std::pair<const float*, const float*>{k.data() + row, v.data() + row};
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
