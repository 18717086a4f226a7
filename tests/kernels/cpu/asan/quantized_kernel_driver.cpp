// Runs the CPU kernel on keys and values in mx.quantize's affine format (4 and
// 8 bits, groups of 32, 64 and 128, float32 or float16 scales and biases)
// with float16, bfloat16 and float32 queries: GQA groups of 1 to 16, 1 to 3
// query rows, uneven lengths, starts, windows and a softcap. Every position
// past a request's length holds NaN scales and biases, which must change
// nothing. Buffers are exact-size heap allocations, so that built with
// AddressSanitizer + UBSan any access outside them is reported, and the
// driver also runs the kernel's arm64 build under emulation
// (tests/kernels/cpu/test_arm64_kernel.py). Each output is checked against a
// float64 reference on the dequantized keys and values, within the rounding
// of the output's dtype.
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

// One side's packed integers [B, H_kv, T, D * bits / 32], its scales and
// biases [B, H_kv, T, groups] in their dtype, and its rows dequantized
// [B, H_kv, T, D] (NaN past each request's length).
struct Side {
  std::vector<uint32_t> words;
  std::vector<float> scales32, biases32;
  std::vector<uint16_t> scales16, biases16;
  std::vector<float> rows;

  const void* scales(Dtype dtype) const {
    return dtype == Dtype::float32 ? static_cast<const void*>(scales32.data()) : scales16.data();
  }
  const void* biases(Dtype dtype) const {
    return dtype == Dtype::float32 ? static_cast<const void*>(biases32.data()) : biases16.data();
  }
};

Side quantized_side(std::mt19937& rng, int B, int H_kv, int T, int D, int bits, int group_size, Dtype sb_dtype,
                    const std::vector<int32_t>& lens) {
  const int words = D * bits / 32, groups = D / group_size;
  const size_t n_rows = size_t(B) * H_kv * T;
  Side s;
  s.words.assign(n_rows * words, 0);
  s.rows.assign(n_rows * D, 0.0f);
  std::vector<float> scale(n_rows * groups), bias(n_rows * groups);
  std::uniform_real_distribution<float> spread(0.5f, 1.5f);
  std::normal_distribution<float> normal;
  for (size_t row = 0; row < n_rows; ++row) {
    const int t = int(row % T), b = int(row / (size_t(H_kv) * T));
    const bool past = t >= std::clamp(lens[b], 0, T);
    for (int g = 0; g < groups; ++g) {
      // Elements of about unit size: bits-wide integers times a step, about centred.
      const float step = rounded(spread(rng) * 4.0f / float(1 << bits), sb_dtype);
      const float offset = rounded(-step * float(1 << (bits - 1)) + 0.25f * normal(rng), sb_dtype);
      scale[row * groups + g] = past ? NAN : step;
      bias[row * groups + g] = past ? NAN : offset;
    }
    uint8_t* bytes = reinterpret_cast<uint8_t*>(s.words.data() + row * words);
    for (int e = 0; e < D; ++e) {
      const uint32_t w = rng() % (1u << bits);
      if (bits == 8) {
        bytes[e] = uint8_t(w);
      } else {
        bytes[e / 2] |= uint8_t(w << (4 * (e % 2)));
      }
      const int g = e / group_size;
      s.rows[row * D + e] = float(double(scale[row * groups + g]) * w + bias[row * groups + g]);
    }
  }
  if (sb_dtype == Dtype::float32) {
    s.scales32 = scale;
    s.biases32 = bias;
  } else {
    for (size_t i = 0; i < scale.size(); ++i) {
      s.scales16.push_back(to_bits(scale[i], sb_dtype));
      s.biases16.push_back(to_bits(bias[i], sb_dtype));
    }
  }
  return s;
}

} // namespace

int main() {
  std::mt19937 rng(29);
  std::normal_distribution<float> normal;
  const Dtype dtypes[] = {Dtype::float16, Dtype::bfloat16, Dtype::float32};
  const int group_sizes[] = {32, 64, 128};
  const int gqa[] = {1, 2, 4, 5, 8, 16};
  int failures = 0, checked = 0;
  for (int round = 0; round < 96; ++round) {
    const Dtype dtype = dtypes[round % 3];
    const int bits = round % 2 ? 4 : 8, group_size = group_sizes[(round / 2) % 3];
    // Head dims that are multiples of the group size, values of one group now and then.
    const int D = group_size == 128 ? 128 : (group_size == 32 && round % 4 == 0 ? 96 : 64 + 64 * int(rng() % 2));
    const int Dv = round % 7 == 3 ? group_size : D;
    const Dtype sb_dtype = round % 4 == 1 ? Dtype::float16 : Dtype::float32;
    const int B = 1 + rng() % 3, H_kv = 1 + rng() % 2, G = gqa[rng() % 6], L = 1 + rng() % 3;
    const int H_q = H_kv * G, T = 1 + int(rng() % 150);
    std::vector<int32_t> lens(B), starts(B);
    for (int b = 0; b < B; ++b) {
      // Full now and then, so that the last rows of the allocations are read.
      lens[b] = rng() % 4 == 0 ? T : int(rng() % (T + 1));
      starts[b] = rng() % 3 == 0 ? int(rng() % (T + 1)) : 0;
    }
    const int window = round % 3 == 2 ? 1 + int(rng() % T) : T;
    const Side k = quantized_side(rng, B, H_kv, T, D, bits, group_size, sb_dtype, lens);
    const Side v = quantized_side(rng, B, H_kv, T, Dv, bits, group_size, sb_dtype, lens);
    // Queries exact in their dtype: the reference reads them as the kernel does.
    std::vector<float> q(size_t(B) * H_q * L * D);
    for (float& x : q) {
      x = rounded(normal(rng), dtype);
    }
    std::vector<uint16_t> q16(q.size());
    for (size_t i = 0; i < q.size(); ++i) {
      q16[i] = dtype == Dtype::float32 ? 0 : to_bits(q[i], dtype);
    }
    DtypeArray out(dtype, size_t(B) * H_q * L * Dv);

    DecodeArgs a{};
    a.queries = dtype == Dtype::float32 ? static_cast<const void*>(q.data()) : q16.data();
    a.keys = k.words.data();
    a.values = v.words.data();
    a.valid_lens = lens.data();
    a.kv_starts = starts.data();
    a.out = out.data();
    a.dtype = dtype;
    a.B = B, a.H_q = H_q, a.H_kv = H_kv, a.G = G, a.L = L, a.T = T, a.D = D, a.Dp = D;
    a.Dv = Dv, a.Dvp = Dv;
    a.window = window;
    const int64_t q_stride[4] = {int64_t(H_q) * L * D, int64_t(L) * D, D, 1};
    const int kw = D * bits / 32, vw = Dv * bits / 32;
    const int64_t k_stride[4] = {int64_t(H_kv) * T * kw, int64_t(T) * kw, kw, 1};
    const int64_t v_stride[4] = {int64_t(H_kv) * T * vw, int64_t(T) * vw, vw, 1};
    std::copy_n(q_stride, 4, a.q_stride);
    std::copy_n(k_stride, 4, a.k_stride);
    std::copy_n(v_stride, 4, a.v_stride);
    a.out_stride[0] = int64_t(H_q) * L * Dv, a.out_stride[1] = int64_t(L) * Dv, a.out_stride[2] = Dv;
    a.lens_stride = a.starts_stride = 1;
    a.scale = 1.0f / std::sqrt(float(D));
    a.softcap = round % 4 == 3 ? 2.0f : 0.0f;
    a.quant.bits = bits;
    a.quant.group_size = group_size;
    a.quant.scales_dtype = sb_dtype;
    for (int side = 0; side < 2; ++side) {
      const Side& s = side ? v : k;
      const int groups = (side ? Dv : D) / group_size;
      a.quant.scales[side] = s.scales(sb_dtype);
      a.quant.biases[side] = s.biases(sb_dtype);
      const int64_t st[4] = {int64_t(H_kv) * T * groups, int64_t(T) * groups, groups, 1};
      std::copy_n(st, 4, a.quant.scales_stride[side]);
      std::copy_n(st, 4, a.quant.biases_stride[side]);
    }
    run_decode(a);

    // The output's rounding, and the integer query words' (up to 2^-16 of a group's largest element).
    const double tol = dtype == Dtype::float32 ? 2e-4 : dtype == Dtype::float16 ? 2e-3 : 8e-3;
    for (int b = 0; b < B; ++b) {
      const int len = std::clamp(lens[b], 0, T), start = std::clamp(starts[b], 0, T);
      for (int h = 0; h < H_q; ++h) {
        const int64_t head = (int64_t(b) * H_kv + h / G) * T;
        for (int i = 0; i < L; ++i) {
          const KeyRange r = a.row_range(len, start, i);
          const int64_t row = (int64_t(b) * H_q + h) * L + i;
          const std::vector<double> want = reference_output(
              q.data() + row * D, r.lo, std::max(r.hi, r.lo), D, Dv, [&](int t) {
                return std::pair<const float*, const float*>{k.rows.data() + (head + t) * D,
                                                             v.rows.data() + (head + t) * Dv};
              }, a.softcap);
          for (int e = 0; e < Dv; ++e) {
            const double got = out.at(row * Dv + e);
            ++checked;
            if (!(std::fabs(got - want[e]) <= tol * (1.0 + std::fabs(want[e])))) {
              if (failures++ < 5) {
                std::printf("round %d (bits %d, group %d, D %d, Dv %d, G %d, L %d) b %d h %d i %d e %d: "
                            "got %g want %g\n", round, bits, group_size, D, Dv, G, L, b, h, i, e, got, want[e]);
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
