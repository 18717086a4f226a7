#include "cpu/isa.h"

#include <atomic>
#include <iterator>
#include <stdexcept>

#if defined(__linux__) && (defined(__x86_64__) || defined(_M_X64))
#include <sys/syscall.h>
#include <unistd.h>
#endif

#include "cpu/kernel_table.h"

namespace mlx_batched_decode::cpu {

namespace {

// Variants from worst to best; a variant is available when it was compiled
// in (MBD_HAS_<ISA>) and the CPU (and OS, for AVX-512 state) supports it.
enum class Isa { baseline, avx2, avxvnni, avx512bf16, avx512fp16, amx };
constexpr Isa kIsas[] = {Isa::baseline, Isa::avx2, Isa::avxvnni, Isa::avx512bf16, Isa::avx512fp16, Isa::amx};

// Indexed by Isa.
constexpr const char* kIsaNames[] = {"baseline", "avx2", "avxvnni", "avx512bf16", "avx512fp16", "amx"};

// Indexed by Isa: whether the variant was compiled in (MBD_HAS_<ISA>), whatever the CPU.
constexpr bool kBuilt[] = {
    true,
#if defined(MBD_HAS_AVX2)
    true,
#else
    false,
#endif
#if defined(MBD_HAS_AVXVNNI)
    true,
#else
    false,
#endif
#if defined(MBD_HAS_AVX512BF16)
    true,
#else
    false,
#endif
#if defined(MBD_HAS_AVX512FP16)
    true,
#else
    false,
#endif
#if defined(MBD_HAS_AMX)
    true,
#else
    false,
#endif
};
static_assert(std::size(kBuilt) == std::size(kIsas));

const char* isa_name(Isa isa) {
  return kIsaNames[static_cast<int>(isa)];
}

bool supported(Isa isa) {
#if defined(__x86_64__) || defined(_M_X64)
  const bool avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
      __builtin_cpu_supports("f16c");
#endif
  switch (isa) {
    case Isa::baseline:
      return true;
    case Isa::avx2:
#if defined(MBD_HAS_AVX2) && (defined(__x86_64__) || defined(_M_X64))
      return avx2;
#else
      return false;
#endif
    case Isa::avxvnni:
#if defined(MBD_HAS_AVX2) && defined(MBD_HAS_AVXVNNI) && (defined(__x86_64__) || defined(_M_X64))
      return avx2 && __builtin_cpu_supports("avxvnni");
#else
      return false;
#endif
    case Isa::avx512bf16:
#if defined(MBD_HAS_AVX512BF16) && (defined(__x86_64__) || defined(_M_X64))
      return avx2 && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512vl") &&
          __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512bf16") &&
          __builtin_cpu_supports("avx512vnni");
#else
      return false;
#endif
    case Isa::avx512fp16:
#if defined(MBD_HAS_AVX512FP16) && (defined(__x86_64__) || defined(_M_X64))
      return supported(Isa::avx512bf16) && __builtin_cpu_supports("avx512fp16");
#else
      return false;
#endif
    case Isa::amx:
#if defined(MBD_HAS_AMX) && (defined(__x86_64__) || defined(_M_X64))
      // The AVX512-FP16 build with its tile path on (CMakeLists.txt); every
      // CPU with AMX so far has AVX512-FP16 too.
      return supported(Isa::avx512fp16) && __builtin_cpu_supports("amx-tile") &&
          __builtin_cpu_supports("amx-bf16") && amx_permitted();
#else
      return false;
#endif
  }
  return false;
}

Isa best_isa() {
  Isa best = Isa::baseline;
  for (Isa isa : kIsas) {
    if (supported(isa)) {
      best = isa;
    }
  }
  return best;
}

std::atomic<Isa>& selected() {
  static std::atomic<Isa> isa{best_isa()};
  return isa;
}

} // namespace

bool amx_permitted() {
#if defined(__linux__) && (defined(__x86_64__) || defined(_M_X64))
  constexpr long kArchReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
  static const bool granted = syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtiledata) == 0;
  return granted;
#else
  return false;
#endif
}

std::vector<std::string> built_isas() {
  std::vector<std::string> names;
  for (Isa isa : kIsas) {
    if (kBuilt[static_cast<int>(isa)]) {
      names.push_back(isa_name(isa));
    }
  }
  return names;
}

std::vector<std::string> available_isas() {
  std::vector<std::string> names;
  for (Isa isa : kIsas) {
    if (supported(isa)) {
      names.push_back(isa_name(isa));
    }
  }
  return names;
}

std::string current_isa() {
  return isa_name(selected().load());
}

bool tiles_selected() {
  return selected().load() == Isa::amx;
}

void set_isa(const std::string& name) {
  for (Isa isa : kIsas) {
    if (name == isa_name(isa) && supported(isa)) {
      selected() = isa;
      return;
    }
  }
  throw std::invalid_argument(
      "[batched_decode_attention] CPU kernel variant '" + name + "' is not available on this machine");
}

// Each variant's own kernels where it compiles them (kernel_table.h), else
// those of the variant it is built on.
KernelFns kernel_fns(Dtype dtype, int head_dim) {
  switch (selected().load()) {
#if defined(MBD_HAS_AVX512FP16)
    // The AMX variant is this build with its tiles allowed (tiles_selected()).
    case Isa::amx:
    case Isa::avx512fp16:
      return avx512fp16::kernel_fns(dtype, head_dim);
#endif
#if defined(MBD_HAS_AVX512BF16)
    case Isa::avx512bf16:
      return avx512bf16::kernel_fns(dtype, head_dim);
#endif
#if defined(MBD_HAS_AVX2)
    // The AVX-VNNI variant's dense kernels are AVX2's.
    case Isa::avxvnni:
    case Isa::avx2:
      return avx2::kernel_fns(dtype, head_dim);
#endif
    default:
      return baseline::kernel_fns(dtype, head_dim);
  }
}

KernelFns quantized_kernel_fns(Dtype dtype, int head_dim, int bits) {
  switch (selected().load()) {
#if defined(MBD_HAS_AVX512BF16)
    case Isa::amx:
    case Isa::avx512fp16:
    case Isa::avx512bf16:
      return avx512bf16::quantized_kernel_fns(dtype, head_dim, bits);
#endif
#if defined(MBD_HAS_AVXVNNI)
    case Isa::avxvnni:
      return avxvnni::quantized_kernel_fns(dtype, head_dim, bits);
#endif
#if defined(MBD_HAS_AVX2)
    case Isa::avx2:
      return avx2::quantized_kernel_fns(dtype, head_dim, bits);
#endif
    default:
      return baseline::quantized_kernel_fns(dtype, head_dim, bits);
  }
}

} // namespace mlx_batched_decode::cpu
