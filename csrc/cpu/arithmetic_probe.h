// The machine's arithmetic peak, measured the way the CPU kernel computes: on
// the kernel's own worker pool, with independent chains of the instruction a
// kernel's inner loop issues and no memory traffic. Benchmarks time it in
// turns with the kernel, as the read probe, to place each call against its
// arithmetic floor (multiply-adds over this rate) beside its memory floor.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace mlx_batched_decode::cpu {

// The units a probe can rate, each counted in multiply-adds (one multiply and
// one add of a pair of elements; a dot-product instruction does several):
//   "fma32"     float32 fused multiply-adds on vectors of `isa`'s width;
//   "bf16_dot"  AVX512_BF16 vdpbf16ps (bfloat16 pairs into float32 lanes);
//   "int16_dot" AVX512-VNNI vpdpwssd (int16 pairs into int32 lanes);
//   "int8_dot"  AVX512-VNNI vpdpbusd (uint8 x int8 quads into int32 lanes);
//   "amx_bf16"  AMX tdpbf16ps (a 16x32 by 32x16 bfloat16 tile product);
//   "amx_int8"  AMX tdpbusd (a 16x64 by 64x16 uint8 x int8 tile product).
std::vector<std::string> arithmetic_units();

// Those of arithmetic_units() this CPU (and OS, for AMX tile state) runs.
std::vector<std::string> available_arithmetic_units();

class ArithmeticProbe {
 public:
  // unit: one of available_arithmetic_units(). isa: the vector width of
  // "fma32", "avx512", "avx2" or "baseline" (128-bit vectors), empty for the
  // widest this CPU runs; the dot-product units have one width and take "".
  // Throws std::invalid_argument for a unit or width this CPU does not run.
  explicit ArithmeticProbe(const std::string& unit, const std::string& isa = "");

  // Runs the probe's multiply-adds once on all of the kernel's threads;
  // returns the seconds it took.
  double run();

  // Multiply-adds per run().
  uint64_t multiply_adds() const;
  const std::string& unit() const {
    return unit_;
  }
  const std::string& isa() const {
    return isa_;
  }
  // Folds the last run's accumulators, so that they cannot be optimised
  // away; the same for every run of a probe (each piece starts afresh).
  uint64_t checksum() const {
    return checksum_;
  }

 private:
  std::string unit_, isa_;
  uint64_t (*piece_)() = nullptr; // one piece's multiply-adds; returns its accumulators
  uint64_t piece_multiply_adds_ = 0;
  uint64_t checksum_ = 0;
};

} // namespace mlx_batched_decode::cpu
