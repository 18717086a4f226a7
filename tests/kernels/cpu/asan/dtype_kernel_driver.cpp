// Runs the CPU kernel on dense rows of every dtype (float16, bfloat16,
// float32) and head dims with kernels of their own and without (32 to 256,
// and 24, 40, 72 on the generic one), values of the keys' head dim or
// another: GQA groups of 1 to 8, 1 to 3 query rows, uneven lengths (full
// ones among them), starts, windows, sinks and a softcap. Every position
// past a request's length holds NaN keys and values, which must change
// nothing. Buffers are exact-size heap allocations, so that built with
// AddressSanitizer + UBSan any access outside them is reported, and the
// driver also runs the kernel's arm64 build under emulation
// (tests/kernels/cpu/test_arm64_kernel.py). Each output is checked against a
// float64 reference within the rounding of its dtype.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <random>
#include <vector>

#include "cpu/decode_args.h"
#include "cpu/parallel_decode.h"
#include "dtypes.h"
#include "reference_row.h"

using namespace mlx_batched_decode::cpu;
using namespace driver_dtypes;

namespace {

// Rows [n, D] of unit normals exact in dtype, as float32 (the reference's)
// and in the dtype (the kernel's: floats or bits); NaN where nan(row).
template <typename Nan>
void fill(std::mt19937& rng, Dtype dtype, size_t n, int D, Nan nan, std::vector<float>& x,
          std::vector<uint16_t>& bits) {
  std::normal_distribution<float> normal;
  x.resize(n * D);
  bits.resize(dtype == Dtype::float32 ? 0 : n * D);
  for (size_t row = 0; row < n; ++row) {
    for (int d = 0; d < D; ++d) {
      const size_t i = row * D + d;
      x[i] = nan(row) ? NAN : rounded(normal(rng), dtype);
      if (dtype != Dtype::float32) {
        bits[i] = to_bits(x[i], dtype);
      }
    }
  }
}

const void* data(Dtype dtype, const std::vector<float>& x, const std::vector<uint16_t>& bits) {
  return dtype == Dtype::float32 ? static_cast<const void*>(x.data()) : bits.data();
}

} // namespace

int main() {
  std::mt19937 rng(31);
  const Dtype dtypes[] = {Dtype::float16, Dtype::bfloat16, Dtype::float32};
  const int head_dims[] = {32, 64, 80, 96, 128, 256, 24, 40, 72};
  const int gqa[] = {1, 2, 4, 8};
  int failures = 0, checked = 0;
  for (int round = 0; round < 90; ++round) {
    const Dtype dtype = dtypes[round % 3];
    const int D = head_dims[(round / 3) % 9];
    const int Dv = round % 5 == 4 ? head_dims[rng() % 9] : D;
    const int B = 1 + rng() % 3, H_kv = 1 + rng() % 2, G = gqa[rng() % 4], L = 1 + rng() % 3;
    const int H_q = H_kv * G, T = 1 + int(rng() % 150);
    std::vector<int32_t> lens(B), starts(B);
    for (int b = 0; b < B; ++b) {
      lens[b] = rng() % 4 == 0 ? T : int(rng() % (T + 1));
      starts[b] = rng() % 3 == 0 ? int(rng() % (T + 1)) : 0;
    }
    const int window = round % 4 == 2 ? 1 + int(rng() % T) : T;
    const bool has_sinks = round % 6 == 1;
    std::vector<float> sinks(H_q);
    for (float& s : sinks) {
      s = std::normal_distribution<float>(0.0f, 2.0f)(rng);
    }
    std::vector<float> q, k, v;
    std::vector<uint16_t> q16, k16, v16;
    const auto past = [&](size_t row) { return int(row % T) >= lens[row / (size_t(H_kv) * T)]; };
    fill(rng, dtype, size_t(B) * H_q * L, D, [](size_t) { return false; }, q, q16);
    fill(rng, dtype, size_t(B) * H_kv * T, D, past, k, k16);
    fill(rng, dtype, size_t(B) * H_kv * T, Dv, past, v, v16);
    DtypeArray out(dtype, size_t(B) * H_q * L * Dv);

    DecodeArgs a{};
    a.queries = data(dtype, q, q16);
    a.keys = data(dtype, k, k16);
    a.values = data(dtype, v, v16);
    a.valid_lens = lens.data();
    a.kv_starts = starts.data();
    a.sinks = has_sinks ? sinks.data() : nullptr;
    a.out = out.data();
    a.dtype = dtype;
    a.B = B, a.H_q = H_q, a.H_kv = H_kv, a.G = G, a.L = L, a.T = T, a.D = D, a.Dp = padded_head_dim(D);
    a.Dv = Dv, a.Dvp = padded_head_dim(Dv);
    a.window = window;
    const int64_t q_stride[4] = {int64_t(H_q) * L * D, int64_t(L) * D, D, 1};
    const int64_t k_stride[4] = {int64_t(H_kv) * T * D, int64_t(T) * D, D, 1};
    const int64_t v_stride[4] = {int64_t(H_kv) * T * Dv, int64_t(T) * Dv, Dv, 1};
    std::copy_n(q_stride, 4, a.q_stride);
    std::copy_n(k_stride, 4, a.k_stride);
    std::copy_n(v_stride, 4, a.v_stride);
    a.out_stride[0] = int64_t(H_q) * L * Dv, a.out_stride[1] = int64_t(L) * Dv, a.out_stride[2] = Dv;
    a.lens_stride = a.starts_stride = a.sinks_stride = 1;
    a.scale = 1.0f / std::sqrt(float(D));
    a.softcap = round % 4 == 3 ? 2.0f : 0.0f;
    run_decode(a);

    // The output's rounding (bfloat16 weights rounded too where the variant has its dot product).
    const double tol = dtype == Dtype::float32 ? 1e-4 : dtype == Dtype::float16 ? 2e-3 : 8e-3;
    for (int b = 0; b < B; ++b) {
      const int len = std::clamp(lens[b], 0, T), start = std::clamp(starts[b], 0, T);
      for (int h = 0; h < H_q; ++h) {
        const int64_t head = (int64_t(b) * H_kv + h / G) * T;
        for (int i = 0; i < L; ++i) {
          const KeyRange r = a.row_range(len, start, i);
          const int64_t row = (int64_t(b) * H_q + h) * L + i;
          // A row with no key is zeros, sink or not.
          const double sink = has_sinks && !r.empty() ? sinks[h] : -INFINITY;
          const std::vector<double> want = reference_output(
              q.data() + row * D, r.lo, std::max(r.hi, r.lo), D, Dv, [&](int t) {
                return std::pair<const float*, const float*>{k.data() + (head + t) * D, v.data() + (head + t) * Dv};
              }, a.softcap, sink);
          for (int e = 0; e < Dv; ++e) {
            const double got = out.at(row * Dv + e);
            ++checked;
            if (!(std::fabs(got - want[e]) <= tol * (1.0 + std::fabs(want[e])))) {
              if (failures++ < 5) {
                std::printf("round %d (D %d, Dv %d, G %d, L %d) b %d h %d i %d e %d: got %g want %g\n", round, D, Dv,
                            G, L, b, h, i, e, got, want[e]);
              }
            }
          }
        }
      }
    }
  }
  std::printf("%s: %d mismatches of %d elements\n", failures ? "FAIL" : "OK", failures, checked);
  return failures ? 1 : 0;
}
