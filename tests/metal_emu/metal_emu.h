// Compatibility header: makes Metal Shading Language parse and run as C++20.
// Reached through the stub <metal_stdlib>; prepass.py rewrites the few things
// a macro cannot (built-in parameters, threadgroup variables, host names).
#pragma once

// Every standard header first: the MSL keyword macros below would break them.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <source_location>
#include <type_traits>

#include "emu_bfloat.h"
#include "emu_runtime.h"
#include "emu_type_traits.h"
#include "emu_vec.h"

// Address spaces and the kernel qualifier carry no meaning on the CPU.
#define kernel
#define device
#define constant
#define thread
#define threadgroup

#define EMU_CAT_(a, b) a##b
#define EMU_CAT(a, b) EMU_CAT_(a, b)
#define EMU_UNIQUE EMU_CAT(emu_unique_, __COUNTER__)

namespace metal {

typedef unsigned int uint;
typedef unsigned short ushort;
typedef unsigned char uchar;
typedef unsigned long ulong;
typedef _Float16 half;

#define EMU_VEC_TYPES(T, name) \
  typedef vec<T, 2> name##2;   \
  typedef vec<T, 3> name##3;   \
  typedef vec<T, 4> name##4;
EMU_VEC_TYPES(float, float)
EMU_VEC_TYPES(half, half)
EMU_VEC_TYPES(bfloat, bfloat)
EMU_VEC_TYPES(int, int)
EMU_VEC_TYPES(uint, uint)
EMU_VEC_TYPES(short, short)
EMU_VEC_TYPES(ushort, ushort)
EMU_VEC_TYPES(ulong, ulong)
#undef EMU_VEC_TYPES

using std::numeric_limits;

// Math on float; half and bfloat arguments are widened like the GPU does.
#define EMU_UNARY(name, impl) \
  inline float name(float x) { return impl(x); }
EMU_UNARY(exp, std::exp)
EMU_UNARY(exp2, std::exp2)
EMU_UNARY(log, std::log)
EMU_UNARY(log2, std::log2)
EMU_UNARY(sqrt, std::sqrt)
EMU_UNARY(abs, std::fabs)
EMU_UNARY(tanh, std::tanh)
#undef EMU_UNARY
inline float rsqrt(float x) { return 1.0f / std::sqrt(x); }
inline bool isnan(float x) { return std::isnan(x); }
inline bool isinf(float x) { return std::isinf(x); }
inline float fma(float a, float b, float c) { return std::fma(a, b, c); }

template <typename T>
T max(T a, T b) { return a < b ? b : a; }
template <typename T>
T min(T a, T b) { return b < a ? b : a; }
// On floats, as MSL's fmax/fmin outside fast math: a NaN argument yields the other one.
inline float max(float a, float b) { return std::fmax(a, b); }
inline float min(float a, float b) { return std::fmin(a, b); }
template <typename T>
T clamp(T x, T lo, T hi) { return min(max(x, lo), hi); }

namespace fast {
using metal::exp;
using metal::exp2;
using metal::log;
using metal::rsqrt;
using metal::sqrt;
} // namespace fast
namespace precise {
using metal::exp;
using metal::exp2;
using metal::log;
using metal::rsqrt;
using metal::sqrt;
using metal::tanh;
} // namespace precise

enum class mem_flags { mem_none = 0, mem_device = 1, mem_threadgroup = 2, mem_texture = 4 };

/** All threads of the threadgroup meet here; a full fence on the CPU. */
inline void threadgroup_barrier(mem_flags, std::source_location where = std::source_location::current()) {
  emu::rendezvous(emu::Scope::group, "threadgroup_barrier", where, nullptr, nullptr,
                  [](const void* const*, void* const*, int) {});
}

inline void simdgroup_barrier(mem_flags, std::source_location where = std::source_location::current()) {
  emu::rendezvous(emu::Scope::simd, "simdgroup_barrier", where, nullptr, nullptr,
                  [](const void* const*, void* const*, int) {});
}

// Reduction over the simdgroup's lanes, same value for every lane.
#define EMU_SIMD_REDUCE(name, combine)                                                  \
  template <typename T>                                                                \
  T name(T x, std::source_location where = std::source_location::current()) {          \
    T out;                                                                             \
    emu::rendezvous(emu::Scope::simd, #name, where, &x, &out,                     \
                    [](const void* const* in, void* const* res, int n) {               \
                      T acc = *static_cast<const T*>(in[0]);                           \
                      for (int i = 1; i < n; ++i) {                                    \
                        const T& b = *static_cast<const T*>(in[i]);                    \
                        acc = combine;                                                 \
                      }                                                                \
                      for (int i = 0; i < n; ++i) *static_cast<T*>(res[i]) = acc;      \
                    });                                                                \
    return out;                                                                        \
  }
EMU_SIMD_REDUCE(simd_sum, acc + b)
EMU_SIMD_REDUCE(simd_max, max(acc, b))
EMU_SIMD_REDUCE(simd_min, min(acc, b))
#undef EMU_SIMD_REDUCE

template <typename T>
struct LaneValue {
  T value;
  uint arg;
};

// Lane i receives the value of lane pick(i, arg_i).
#define EMU_SIMD_PERMUTE(name, pick)                                                   \
  template <typename T>                                                                \
  T name(T x, ushort arg, std::source_location where = std::source_location::current()) { \
    LaneValue<T> in{x, arg};                                                           \
    T out;                                                                             \
    emu::rendezvous(emu::Scope::simd, #name, where, &in, &out,                    \
                    [](const void* const* ins, void* const* res, int n) {              \
                      for (int i = 0; i < n; ++i) {                                    \
                        const uint a = static_cast<const LaneValue<T>*>(ins[i])->arg;  \
                        const uint src = (pick) % uint(n);                             \
                        *static_cast<T*>(res[i]) = static_cast<const LaneValue<T>*>(ins[src])->value; \
                      }                                                                \
                    });                                                                \
    return out;                                                                        \
  }
EMU_SIMD_PERMUTE(simd_shuffle, a)
EMU_SIMD_PERMUTE(simd_shuffle_xor, uint(i) ^ a)
EMU_SIMD_PERMUTE(simd_broadcast, a)
#undef EMU_SIMD_PERMUTE

} // namespace metal

#include "emu_simdgroup_matrix.h"

// MSL's scalar and vector types are global names (MLX's headers use them before any `using namespace metal`).
using metal::bfloat;
using metal::half;
using metal::uchar;
using metal::uint;
using metal::ulong;
using metal::ushort;
#define EMU_GLOBAL_VEC_TYPES(name) \
  using metal::name##2;            \
  using metal::name##3;            \
  using metal::name##4;
EMU_GLOBAL_VEC_TYPES(float)
EMU_GLOBAL_VEC_TYPES(half)
EMU_GLOBAL_VEC_TYPES(bfloat)
EMU_GLOBAL_VEC_TYPES(int)
EMU_GLOBAL_VEC_TYPES(uint)
EMU_GLOBAL_VEC_TYPES(short)
EMU_GLOBAL_VEC_TYPES(ushort)
EMU_GLOBAL_VEC_TYPES(ulong)
#undef EMU_GLOBAL_VEC_TYPES

namespace emu {

/** A 3-component built-in that, like Metal's, may be declared uint, uint2 or uint3. */
struct Builtin3 {
  unsigned x, y, z;
  operator unsigned() const { return x; }
  operator metal::uint2() const { return metal::uint2(x, y); }
  operator metal::uint3() const { return metal::uint3(x, y, z); }
  operator metal::ushort2() const { return metal::ushort2(x, y); }
  operator metal::ushort3() const { return metal::ushort3(x, y, z); }
};

// Built-in parameter values of the running lane, named after their attributes.
namespace builtins {
inline Builtin3 threadgroup_position_in_grid() {
  const unsigned* p = lane().threadgroup_position_in_grid;
  return {p[0], p[1], p[2]};
}
inline Builtin3 threads_per_threadgroup() {
  const unsigned* p = lane().threads_per_threadgroup;
  return {p[0], p[1], p[2]};
}
inline Builtin3 threadgroups_per_grid() {
  const unsigned* p = lane().threadgroups_per_grid;
  return {p[0], p[1], p[2]};
}
inline Builtin3 thread_position_in_threadgroup() {
  const LaneContext& c = lane();
  const unsigned i = c.thread_index_in_threadgroup;
  const unsigned* g = c.threads_per_threadgroup;
  return {i % g[0], i / g[0] % g[1], i / (g[0] * g[1])};
}
inline Builtin3 thread_position_in_grid() {
  const Builtin3 local = thread_position_in_threadgroup();
  const LaneContext& c = lane();
  const unsigned* p = c.threadgroup_position_in_grid;
  const unsigned* g = c.threads_per_threadgroup;
  return {p[0] * g[0] + local.x, p[1] * g[1] + local.y, p[2] * g[2] + local.z};
}
inline unsigned thread_index_in_threadgroup() { return lane().thread_index_in_threadgroup; }
inline unsigned simdgroup_index_in_threadgroup() { return lane().simdgroup_index_in_threadgroup; }
inline unsigned thread_index_in_simdgroup() { return lane().thread_index_in_simdgroup; }
inline unsigned simdgroups_per_threadgroup() { return lane().simdgroups_per_threadgroup; }
inline unsigned threads_per_simdgroup() { return lane().threads_per_simdgroup; }
} // namespace builtins

/** Program-scope `constant T x [[function_constant(i)]]`: its value comes with the launch. */
template <typename T>
struct FunctionConstant {
  int index;
  operator T() const {
    T value;
    read_function_constant(index, &value, sizeof(T));
    return value;
  }
};

/** One argument bound by the host: converts to the kernel's pointer or reference. */
struct Buffer {
  void* data;
  template <typename T>
  operator T*() const { return static_cast<T*>(data); }
  template <typename T, typename = std::enable_if_t<!std::is_pointer_v<T>>>
  operator T&() const { return *static_cast<T*>(data); }
};

/** Calls a kernel with the buffers bound at indices I... (its [[buffer(i)]] in order). */
template <int... I>
struct Call {
  static constexpr int indices[] = {I...};
  static constexpr int count = sizeof...(I);
  template <typename F>
  static void run(F f, void* const* buffers) { f(Buffer{buffers[I]}...); }
};

} // namespace emu
