// Runs the CPU kernel on packed queries (query_starts) with random adversarial
// row counts, lengths and starts, a softcap in every other call, and
// query_starts that are sometimes malformed (decreasing, negative, past N,
// not ending at N): queries, keys,
// values and output are exact-size heap allocations, keys and values of head
// dims of their own, so that built with AddressSanitizer + UBSan by
// tests/kernels/cpu/test_packed_sanitizer.py any access outside them is
// reported. Checks each output against a scalar float64 reference of the
// packed contract; malformed starts must give an all-zero output.
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

// An adversarial position for T cache positions: wild, past T, negative or in range.
int32_t position(std::mt19937& rng, int T) {
  switch (rng() % 5) {
    case 0:
      return rng() % 2 ? INT32_MAX : INT32_MIN;
    case 1:
      return T + 1 + int(rng() % 50);
    case 2:
      return -1 - int(rng() % 5);
    default:
      return int(rng() % (T + 1));
  }
}

// query_starts broken in one of the ways the op rejects when it can read them.
void break_starts(std::mt19937& rng, std::vector<int32_t>& qs) {
  const int B = int(qs.size()) - 1, b = int(rng() % (B + 1));
  switch (rng() % 4) {
    case 0:
      qs[b] = -1 - int(rng() % 3);
      break;
    case 1:
      qs[b] = qs[B] + 1 + int(rng() % 40);
      break;
    case 2:
      qs[B] = std::max(qs[B] - 1, 0) == qs[B] ? qs[B] + 1 : qs[B] - 1;
      break;
    default:
      qs[b] = rng() % 2 ? INT32_MAX : INT32_MIN;
  }
}

} // namespace

int main() {
  std::mt19937 rng(17);
  std::normal_distribution<float> normal;
  const int counts[] = {0, 1, 2, 5, 37};
  int failures = 0;
  for (int round = 0; round < 300; ++round) {
    const int B = 1 + rng() % 6, H_kv = 1 + rng() % 2, G = 1 + rng() % 4, H_q = H_kv * G;
    const int D = round % 3 == 0 ? 40 : (round % 3 == 1 ? 64 : 24);
    const int Dv = round % 2 ? D : 16 + 8 * int(rng() % 7);
    const int T = int(rng() % 70);
    std::vector<int32_t> qs(B + 1, 0), lens(B), starts(B);
    for (int b = 0; b < B; ++b) {
      qs[b + 1] = qs[b] + counts[rng() % 5];
      lens[b] = position(rng, T);
      starts[b] = position(rng, T);
    }
    if (qs[B] == 0) {
      qs[B] = 1;
    }
    const int N = qs[B];
    const std::vector<int32_t> rows_of = qs; // the well-formed starts, for the reference
    // Both with values as wide as the keys (odd rounds) and narrower or wider ones (even).
    const bool malformed = round % 6 >= 4;
    if (malformed) {
      break_starts(rng, qs);
    }
    const bool has_starts = rng() % 2;
    const int window = round % 3 == 0 ? 1 + int(rng() % (T + 2)) : std::max(T, 1);
    std::vector<float> q(size_t(N) * H_q * D), k(size_t(B) * H_kv * T * D), v(size_t(B) * H_kv * T * Dv);
    std::vector<float> out(size_t(N) * H_q * Dv, NAN);
    for (auto* x : {&q, &k, &v}) {
      for (float& e : *x) {
        e = normal(rng);
      }
    }
    DecodeArgs a{};
    a.queries = q.data();
    a.keys = k.data();
    a.values = v.data();
    a.valid_lens = lens.data();
    a.kv_starts = has_starts ? starts.data() : nullptr;
    a.query_starts = qs.data();
    a.query_starts_stride = 1;
    a.out = out.data();
    a.dtype = Dtype::float32;
    a.B = B, a.H_q = H_q, a.H_kv = H_kv, a.G = G, a.L = N, a.T = T, a.D = D, a.Dv = Dv;
    a.Dp = padded_head_dim(D);
    a.Dvp = padded_head_dim(Dv);
    a.window = std::min(window, std::max(T, 1));
    // Packed [N, H_q, D] queries read as [B, H_q, N, D] with batch stride 0; output [N, H_q, Dv].
    const int64_t q_stride[4] = {0, D, int64_t(H_q) * D, 1};
    const int64_t k_stride[4] = {int64_t(H_kv) * T * D, int64_t(T) * D, D, 1};
    const int64_t v_stride[4] = {int64_t(H_kv) * T * Dv, int64_t(T) * Dv, Dv, 1};
    std::copy_n(q_stride, 4, a.q_stride);
    std::copy_n(k_stride, 4, a.k_stride);
    std::copy_n(v_stride, 4, a.v_stride);
    a.out_stride[0] = 0, a.out_stride[1] = Dv, a.out_stride[2] = int64_t(H_q) * Dv;
    a.lens_stride = a.starts_stride = 1;
    a.scale = 1.0f / std::sqrt(float(D));
    // Scores of unit-normal rows reach about 3: a cap of 1.5 changes most weights.
    a.softcap = round % 2 ? 0.0f : 1.5f;
    run_decode(a);
    for (int b = 0; b < B; ++b) {
      const int len = std::clamp(lens[b], 0, T), start = has_starts ? std::clamp(starts[b], 0, T) : 0;
      const int q_b = rows_of[b + 1] - rows_of[b];
      for (int h = 0; h < H_q; ++h) {
        for (int i = 0; i < q_b; ++i) {
          const int p = len - q_b + i, lo = std::max({start, p - a.window + 1, 0}), hi = p + 1;
          const int64_t row = int64_t(rows_of[b] + i) * H_q + h;
          for (int e = 0; e < Dv; e += 5) {
            const int64_t head = (int64_t(b) * H_kv + h / G) * T;
            const double want = malformed ? 0.0 : reference_row(q.data() + row * D, lo, hi, D, e, [&](int t) {
              return std::pair<const float*, const float*>{k.data() + (head + t) * D, v.data() + (head + t) * Dv};
            }, a.softcap);
            const double got = out[row * Dv + e];
            if (!(std::fabs(got - want) < 1e-4)) {
              if (failures++ < 5) {
                std::printf("round %d b %d h %d i %d e %d: got %g want %g%s\n", round, b, h, i, e, got, want,
                            malformed ? " (malformed starts)" : "");
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
