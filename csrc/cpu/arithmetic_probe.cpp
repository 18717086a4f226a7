#include "cpu/arithmetic_probe.h"

#include <algorithm>
#include <chrono>
#include <cstring>
#include <stdexcept>

#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#endif

#include "cpu/all_threads.h"
#include "cpu/isa.h"

namespace mlx_batched_decode::cpu {

namespace {

// Pieces per run(), each claimed by one thread as the kernel claims work items.
constexpr size_t kPieces = 128;

// Enough independent accumulators to cover the instruction's latency on every
// port that issues it (4 cycles x 2 ports for an FMA); AVX2 and 128-bit
// vectors have 16 registers, AVX-512 32.
constexpr int kWideChains = 16;
constexpr int kNarrowChains = 12;

// Iterations of each piece: about 16 M multiply-adds for the vector units and
// 256 M for AMX tiles (each piece a fraction of a millisecond at the peak).
constexpr int kFmaIters = 1 << 16;
constexpr int kDotIters = 1 << 15;
constexpr int kTileIters = 1 << 13;

template <typename T>
uint64_t fold(const T* values, size_t n) {
  uint64_t sum = 0;
  for (size_t i = 0; i < n; ++i) {
    uint32_t bits = 0;
    std::memcpy(&bits, &values[i], sizeof(bits));
    sum = (sum ^ bits) * 0x100000001b3ull;
  }
  return sum;
}

// acc = acc * a + b converges to b / (1 - a) = 1, so no chain overflows or
// turns subnormal however long it runs.
constexpr float kScale = 0.999f, kOffset = 0.001f;

// 128-bit vectors in GCC's vector extension: SSE multiplies and adds on
// baseline x86-64, NEON fused multiply-adds on arm64.
typedef float Float4 __attribute__((vector_size(16)));

uint64_t fma_baseline() {
  Float4 acc[kNarrowChains];
  for (int c = 0; c < kNarrowChains; ++c) {
    acc[c] = Float4{} + 0.5f + 0.01f * c;
  }
  const Float4 a = Float4{} + kScale, b = Float4{} + kOffset;
  for (int i = 0; i < kFmaIters; ++i) {
    for (auto& x : acc) {
      x = x * a + b;
    }
  }
  return fold(reinterpret_cast<const float*>(acc), sizeof(acc) / sizeof(float));
}

#if defined(__x86_64__) || defined(_M_X64)
__attribute__((target("avx2,fma"))) uint64_t fma_avx2() {
  __m256 acc[kNarrowChains];
  for (int c = 0; c < kNarrowChains; ++c) {
    acc[c] = _mm256_set1_ps(0.5f + 0.01f * c);
  }
  const __m256 a = _mm256_set1_ps(kScale), b = _mm256_set1_ps(kOffset);
  for (int i = 0; i < kFmaIters; ++i) {
    for (auto& x : acc) {
      x = _mm256_fmadd_ps(x, a, b);
    }
  }
  return fold(reinterpret_cast<const float*>(acc), sizeof(acc) / sizeof(float));
}

__attribute__((target("avx512f"))) uint64_t fma_avx512() {
  __m512 acc[kWideChains];
  for (int c = 0; c < kWideChains; ++c) {
    acc[c] = _mm512_set1_ps(0.5f + 0.01f * c);
  }
  const __m512 a = _mm512_set1_ps(kScale), b = _mm512_set1_ps(kOffset);
  for (int i = 0; i < kFmaIters; ++i) {
    for (auto& x : acc) {
      x = _mm512_fmadd_ps(x, a, b);
    }
  }
  return fold(reinterpret_cast<const float*>(acc), sizeof(acc) / sizeof(float));
}

// bfloat16 2^-6 in both halves of every 32-bit lane: each vdpbf16ps adds
// 2 x 2^-12 to a lane, 2^-1 over a piece, exact in float32.
constexpr uint32_t kBf16Pair = 0x3c803c80u;

__attribute__((target("avx512f,avx512bf16"))) uint64_t bf16_dot() {
  __m512 acc[kWideChains];
  for (auto& x : acc) {
    x = _mm512_setzero_ps();
  }
  const __m512bh a = (__m512bh)_mm512_set1_epi32(static_cast<int>(kBf16Pair));
  for (int i = 0; i < kDotIters; ++i) {
    for (auto& x : acc) {
      x = _mm512_dpbf16_ps(x, a, a);
    }
  }
  return fold(reinterpret_cast<const float*>(acc), sizeof(acc) / sizeof(float));
}

// AVX512-VNNI's integer dot products on ones. Words: int16 1 x int16 1 in
// every word, each vpdpwssd adding 2 to a lane (the quantized kernels' scores
// on 16-bit queries, quantized_tiles.h); else uint8 1 x int8 1 in every byte,
// each vpdpbusd adding 4.
template <bool Words>
__attribute__((target("avx512f,avx512vnni"))) uint64_t integer_dot() {
  __m512i acc[kWideChains];
  for (auto& x : acc) {
    x = _mm512_setzero_si512();
  }
  const __m512i a = Words ? _mm512_set1_epi16(1) : _mm512_set1_epi8(1);
  for (int i = 0; i < kDotIters; ++i) {
    for (auto& x : acc) {
      x = Words ? _mm512_dpwssd_epi32(x, a, a) : _mm512_dpbusd_epi32(x, a, a);
    }
  }
  return fold(reinterpret_cast<const int32_t*>(acc), sizeof(acc) / sizeof(int32_t));
}

// Palette 1, every tile 16 rows of 64 bytes: tiles 0-3 accumulate, 4-5 are
// left operands, 6-7 right ones, so four products are in flight at once.
struct alignas(64) TileConfig {
  uint8_t palette, start_row, reserved[14];
  uint16_t colsb[16];
  uint8_t rows[16];
};
constexpr TileConfig kTiles = {1, 0, {}, {64, 64, 64, 64, 64, 64, 64, 64}, {16, 16, 16, 16, 16, 16, 16, 16}};

// One 16 x 64-byte operand tile of `word` in every 32-bit element, and room
// for the four accumulators read back.
struct TileBuffers {
  alignas(64) uint32_t operand[16 * 16];
  alignas(64) uint32_t out[4][16 * 16];
  explicit TileBuffers(uint32_t word) {
    std::fill(std::begin(operand), std::end(operand), word);
  }
};

// Four tile products of one kind in flight, kTileIters times: tdpbusd on
// int8 ones (Int8), else tdpbf16ps on the bfloat16 pairs.
template <bool Int8>
__attribute__((target("amx-tile,amx-bf16,amx-int8"))) uint64_t tile_products() {
  TileBuffers t(Int8 ? 0x01010101u : kBf16Pair);
  _tile_loadconfig(&kTiles);
  _tile_zero(0);
  _tile_zero(1);
  _tile_zero(2);
  _tile_zero(3);
  _tile_loadd(4, t.operand, 64);
  _tile_loadd(5, t.operand, 64);
  _tile_loadd(6, t.operand, 64);
  _tile_loadd(7, t.operand, 64);
  for (int i = 0; i < kTileIters; ++i) {
    if constexpr (Int8) {
      _tile_dpbusd(0, 4, 6);
      _tile_dpbusd(1, 4, 7);
      _tile_dpbusd(2, 5, 6);
      _tile_dpbusd(3, 5, 7);
    } else {
      _tile_dpbf16ps(0, 4, 6);
      _tile_dpbf16ps(1, 4, 7);
      _tile_dpbf16ps(2, 5, 6);
      _tile_dpbf16ps(3, 5, 7);
    }
  }
  _tile_stored(0, t.out[0], 64);
  _tile_stored(1, t.out[1], 64);
  _tile_stored(2, t.out[2], 64);
  _tile_stored(3, t.out[3], 64);
  _tile_release();
  return fold(&t.out[0][0], 4 * 16 * 16);
}
#endif

struct Unit {
  const char* name;
  const char* isa; // the width of "fma32"; empty for the dot-product units
  uint64_t (*piece)();
  uint64_t multiply_adds; // per piece
  bool (*supported)();
};

bool always() {
  return true;
}

#if defined(__x86_64__) || defined(_M_X64)
bool has_avx2() {
  return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
}
bool has_avx512() {
  return __builtin_cpu_supports("avx512f");
}
bool has_bf16_dot() {
  return has_avx512() && __builtin_cpu_supports("avx512bf16");
}
bool has_avx512_vnni() {
  return has_avx512() && __builtin_cpu_supports("avx512vnni");
}
bool has_amx_bf16() {
  return __builtin_cpu_supports("amx-tile") && __builtin_cpu_supports("amx-bf16") && amx_permitted();
}
bool has_amx_int8() {
  return __builtin_cpu_supports("amx-tile") && __builtin_cpu_supports("amx-int8") && amx_permitted();
}
#endif

// Per piece: iterations x chains (or tiles) x multiply-adds per instruction.
constexpr Unit kUnits[] = {
#if defined(__x86_64__) || defined(_M_X64)
    {"fma32", "avx512", fma_avx512, uint64_t{kFmaIters} * kWideChains * 16, has_avx512},
    {"fma32", "avx2", fma_avx2, uint64_t{kFmaIters} * kNarrowChains * 8, has_avx2},
#endif
    {"fma32", "baseline", fma_baseline, uint64_t{kFmaIters} * kNarrowChains * 4, always},
#if defined(__x86_64__) || defined(_M_X64)
    {"bf16_dot", "", bf16_dot, uint64_t{kDotIters} * kWideChains * 16 * 2, has_bf16_dot},
    {"int16_dot", "", integer_dot<true>, uint64_t{kDotIters} * kWideChains * 16 * 2, has_avx512_vnni},
    {"int8_dot", "", integer_dot<false>, uint64_t{kDotIters} * kWideChains * 16 * 4, has_avx512_vnni},
    {"amx_bf16", "", tile_products<false>, uint64_t{kTileIters} * 4 * 16 * 16 * 32, has_amx_bf16},
    {"amx_int8", "", tile_products<true>, uint64_t{kTileIters} * 4 * 16 * 16 * 64, has_amx_int8},
#endif
};

} // namespace

std::vector<std::string> arithmetic_units() {
  return {"fma32", "bf16_dot", "int16_dot", "int8_dot", "amx_bf16", "amx_int8"};
}

std::vector<std::string> available_arithmetic_units() {
  std::vector<std::string> names;
  for (const auto& name : arithmetic_units()) {
    for (const Unit& u : kUnits) {
      if (name == u.name && u.supported()) {
        names.push_back(name);
        break;
      }
    }
  }
  return names;
}

ArithmeticProbe::ArithmeticProbe(const std::string& unit, const std::string& isa) {
  // kUnits lists the widths of "fma32" widest first, so "" takes the widest.
  for (const Unit& u : kUnits) {
    if (unit == u.name && (isa.empty() || isa == u.isa) && u.supported()) {
      unit_ = u.name;
      isa_ = u.isa;
      piece_ = u.piece;
      piece_multiply_adds_ = u.multiply_adds;
      return;
    }
  }
  throw std::invalid_argument(
      "[ArithmeticProbe] unit '" + unit + "'" + (isa.empty() ? "" : " on '" + isa + "' vectors") +
      " is not available on this machine");
}

double ArithmeticProbe::run() {
  uint64_t (*piece)() = piece_;
  const auto start = std::chrono::steady_clock::now();
  // Every piece folds to the same value, so the XOR of an even count is 0.
  checksum_ = run_pieces(kPieces, [piece](size_t i) { return i == 0 ? piece() : (piece(), 0); });
  const auto stop = std::chrono::steady_clock::now();
  return std::chrono::duration<double>(stop - start).count();
}

uint64_t ArithmeticProbe::multiply_adds() const {
  return piece_multiply_adds_ * kPieces;
}

} // namespace mlx_batched_decode::cpu
