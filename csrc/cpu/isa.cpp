#include "cpu/isa.h"

#include <atomic>
#include <stdexcept>

#include "cpu/kernel_table.h"

namespace mlx_batched_decode::cpu {

namespace {

bool cpu_has_avx2() {
#if defined(MBD_HAS_AVX2) && (defined(__x86_64__) || defined(_M_X64))
  return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
      __builtin_cpu_supports("f16c");
#else
  return false;
#endif
}

enum class Isa { baseline, avx2 };

Isa best_isa() {
  return cpu_has_avx2() ? Isa::avx2 : Isa::baseline;
}

std::atomic<Isa>& selected() {
  static std::atomic<Isa> isa{best_isa()};
  return isa;
}

const char* isa_name(Isa isa) {
  return isa == Isa::avx2 ? "avx2" : "baseline";
}

} // namespace

std::vector<std::string> available_isas() {
  std::vector<std::string> names{"baseline"};
  if (cpu_has_avx2()) {
    names.push_back("avx2");
  }
  return names;
}

std::string current_isa() {
  return isa_name(selected().load());
}

void set_isa(const std::string& name) {
  if (name == "baseline") {
    selected() = Isa::baseline;
  } else if (name == "avx2" && cpu_has_avx2()) {
    selected() = Isa::avx2;
  } else {
    throw std::invalid_argument(
        "[batched_decode_attention] CPU kernel variant '" + name +
        "' is not available on this machine");
  }
}

KernelFns kernel_fns(Dtype dtype, int head_dim) {
#if defined(MBD_HAS_AVX2)
  if (selected().load() == Isa::avx2) {
    return avx2::kernel_fns(dtype, head_dim);
  }
#endif
  return baseline::kernel_fns(dtype, head_dim);
}

} // namespace mlx_batched_decode::cpu
