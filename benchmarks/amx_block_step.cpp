// The CPU kernel's AMX block step (csrc/cpu/amx_tiles.h) on one 32-key block
// of float16 keys and values that stays in L1, repeated: the cost of each step
// alone and of the whole step, without the kernel's memory traffic, row setup
// and calls. One row group (R = 16 query rows, G x L = 4 x 4), D = 128; the
// whole step also for four row groups (R = 64: 16 requests sharing pages at
// G = 4, L = 1), whose queries and accumulators no longer fit in L1 beside
// the block's split keys and values.
// `offset` starts the key and value rows that many elements past a cache line
// (MLX's CPU arrays start 24 bytes, 12 elements, past one).
//
//   g++ -O3 -std=c++20 -DNDEBUG -DMBD_CPU_ISA=avx512fp16 -mavx2 -mfma -mf16c -mavx512f -mavx512vl \
//     -mavx512bw -mavx512bf16 -mavx512vnni -mavx512fp16 -mamx-tile -mamx-bf16 -Icsrc \
//     -I"$(python -c 'import mlx, os; print(os.path.join(mlx.__path__[0], "include"))')" \
//     benchmarks/amx_block_step.cpp -o /tmp/amx_block_step
//   /tmp/amx_block_step benchmarks/results/amx_block_step.json
#include <sys/syscall.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <random>
#include <string>
#include <vector>

#include "cpu/amx_tiles.h"

namespace cpu = mlx_batched_decode::cpu;
namespace amx = mlx_batched_decode::cpu::avx512fp16::amx;
namespace mx = mlx::core;

namespace {

constexpr int kD = 128, kR = 16, kN = 32, kRepeats = 200000;

double seconds() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

// One block's inputs and the state of `groups` row groups, the rows `offset`
// elements past a cache line.
struct Block {
  int groups;
  cpu::LineVector<mx::float16_t> k, v, q;
  const mx::float16_t* k_rows[kN];
  const mx::float16_t* v_rows[kN];
  std::vector<const mx::float16_t*> q_rows;
  amx::Scratch s;
  cpu::LineVector<float> acc, m, l;

  Block(int offset, int groups)
      : groups(groups), k(kN * kD + offset), v(kN * kD + offset), q(groups * kR * kD), q_rows(groups * kR),
        acc(groups * kR * kD), m(groups * kR), l(groups * kR) {
    std::mt19937 rng(1);
    std::normal_distribution<float> normal;
    for (int i = 0; i < kN * kD; ++i) {
      k[offset + i] = mx::float16_t(normal(rng));
      v[offset + i] = mx::float16_t(normal(rng));
    }
    for (auto& x : q) {
      x = mx::float16_t(normal(rng));
    }
    for (int j = 0; j < kN; ++j) {
      k_rows[j] = k.data() + offset + j * kD;
      v_rows[j] = v.data() + offset + j * kD;
    }
    for (int r = 0; r < groups * kR; ++r) {
      q_rows[r] = q.data() + r * kD;
      m[r] = -__builtin_inff();
    }
    s.reserve(groups, kD, kD);
    amx::transpose_queries(q_rows.data(), 1, groups * kR, kD, kD, s);
  }

  // The block step as AmxItem::block runs it, with `skip` left out (-1: none):
  // the keys and values split once, then each row group in turn.
  bool step(int t, int skip) {
    bool finite = true;
    if (skip != 0) {
      finite &= amx::split_keys(k_rows, kN, kD, kD, s);
    }
    if (skip != 1) {
      finite &= amx::pair_values(v_rows, kN, kD, s);
    }
    for (int g = 0; g < groups; ++g) {
      if (skip != 2) {
        amx::scores(s, s.k_hi.data(), kD, g, kD, true, s.s.data());
      }
      float* gm = m.data() + g * kR;
      float* gl = l.data() + g * kR;
      __m512 mm = _mm512_loadu_ps(gm), ll = _mm512_loadu_ps(gl), alpha = _mm512_set1_ps(1.0f);
      if (skip != 3) {
        alpha = amx::softmax(s.s.data(), t, kN, 0.088f, 0.0f, _mm512_setzero_si512(), _mm512_set1_epi32(1 << 30), true, mm,
                             ll, amx::NextBlock{});
      }
      _mm512_storeu_ps(gm, mm);
      _mm512_storeu_ps(gl, ll);
      if (skip != 4) {
        amx::transpose_weights(s.s.data(), s);
      }
      if (skip != 5) {
        amx::accumulate(s, kD, true, acc.data() + g * kR * kD, alpha);
      }
    }
    return finite;
  }

  // One step alone (0-5, the order of step()).
  void alone(int which, int t) {
    __m512 mm = _mm512_loadu_ps(m.data()), ll = _mm512_loadu_ps(l.data());
    switch (which) {
      case 0: amx::split_keys(k_rows, kN, kD, kD, s); break;
      case 1: amx::pair_values(v_rows, kN, kD, s); break;
      case 2: amx::scores(s, s.k_hi.data(), kD, 0, kD, true, s.s.data()); break;
      case 3:
        amx::softmax(s.s.data(), t, kN, 0.088f, 0.0f, _mm512_setzero_si512(), _mm512_set1_epi32(1 << 30), true, mm, ll,
                     amx::NextBlock{});
        break;
      case 4: amx::transpose_weights(s.s.data(), s); break;
      default: amx::accumulate(s, kD, true, acc.data(), _mm512_set1_ps(1.0f)); break;
    }
  }
};

template <typename F>
double ns_per_block(F&& f) {
  for (int i = 0; i < 2000; ++i) {
    f(i);
  }
  const double start = seconds();
  for (int i = 0; i < kRepeats; ++i) {
    f(i);
  }
  return (seconds() - start) * 1e9 / kRepeats;
}

} // namespace

int main(int argc, char** argv) {
  // Linux grants the tile state on request (ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA).
  if (syscall(SYS_arch_prctl, 0x1023, 18) != 0) {
    std::fprintf(stderr, "this CPU or kernel grants no AMX tile state\n");
    return 1;
  }
  const char* names[6] = {"split_keys", "pair_values", "scores", "softmax", "transpose_weights", "accumulate"};
  std::string json = "{\"D\": 128, \"rows\": 16, \"keys\": 32, \"ns_per_block\": {";
  std::printf("%-18s %10s %10s\n", "ns per block", "offset 0", "offset 12");
  double whole[2], alone[2][6], without[2][6];
  for (int o = 0; o < 2; ++o) {
    Block b(o == 0 ? 0 : 12, 1);
    amx::configure();
    whole[o] = ns_per_block([&](int i) { b.step(i * kN, -1); });
    for (int w = 0; w < 6; ++w) {
      alone[o][w] = ns_per_block([&](int i) { b.alone(w, i * kN); });
      without[o][w] = ns_per_block([&](int i) { b.step(i * kN, w); });
    }
    amx::release();
  }
  // Four row groups, as an item of 16 requests sharing pages at G = 4 runs them.
  double whole64[2];
  for (int o = 0; o < 2; ++o) {
    Block b(o == 0 ? 0 : 12, 4);
    amx::configure();
    whole64[o] = ns_per_block([&](int i) { b.step(i * kN, -1); });
    amx::release();
  }
  std::printf("%-18s %10.0f %10.0f\n", "whole step", whole[0], whole[1]);
  std::printf("%-18s %10.0f %10.0f\n", "64 rows, whole", whole64[0], whole64[1]);
  for (int w = 0; w < 6; ++w) {
    std::printf("%-18s %10.0f %10.0f   (whole step without it: %.0f / %.0f)\n", names[w], alone[0][w], alone[1][w],
                without[0][w], without[1][w]);
  }
  for (int o = 0; o < 2; ++o) {
    json += std::string(o ? ", " : "") + "\"offset " + (o ? "12" : "0") + "\": {\"whole step\": " +
            std::to_string(whole[o]);
    for (int w = 0; w < 6; ++w) {
      json += std::string(", \"") + names[w] + "\": " + std::to_string(alone[o][w]) + ", \"without " + names[w] +
              "\": " + std::to_string(without[o][w]);
    }
    json += "}";
  }
  json += "}, \"ns_per_block_64_rows\": {\"offset 0\": " + std::to_string(whole64[0]) + ", \"offset 12\": " +
          std::to_string(whole64[1]) + "}}\n";
  if (argc > 1) {
    std::ofstream(argv[1]) << json;
    std::printf("saved %s\n", argv[1]);
  }
}
