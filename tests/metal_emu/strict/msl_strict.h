// MSL, as far as the kernels use it, for an address-space-strict clang compile
// (-fsyntax-only; see strict/compile.py). Unlike the emulation header
// (metal_emu.h), nothing here runs: it only has to type-check as Apple's
// compiler would.
//
// - device, constant and threadgroup are distinct clang address spaces; thread
//   is the default one. A pointer or reference of one never converts to
//   another, and a member function called on an object of a named address
//   space is rejected unless MSL would take it (builtin types only).
// - constant also means const: MSL's constant address space is read-only.
// - half is _Float16 and bfloat is __bf16 (builtin scalars, so a load from any
//   address space converts, as MSL's do; the aarch64 target with +bf16 has both).
// - vec<T, N> converts from a vec of any address space (copy: implicitly;
//   another element type: explicitly, as float4(half4) in MSL), has .xyzw and
//   .rgba, [i] and element-wise arithmetic; multi-component swizzles are not
//   modelled.
// - the metal_stdlib functions are declarations of MSL's overloads only.
#pragma once

#define device __attribute__((address_space(1)))
#define constant const __attribute__((address_space(2)))
#define threadgroup __attribute__((address_space(3)))
#define thread

typedef __SIZE_TYPE__ size_t;
typedef __PTRDIFF_TYPE__ ptrdiff_t;
typedef unsigned char uchar;
typedef unsigned short ushort;
typedef unsigned int uint;
typedef unsigned long ulong;
typedef signed char int8_t;
typedef short int16_t;
typedef int int32_t;
typedef long int64_t;
typedef unsigned char uint8_t;
typedef unsigned short uint16_t;
typedef unsigned int uint32_t;
typedef unsigned long uint64_t;
typedef _Float16 half;
typedef __bf16 bfloat;

namespace metal {

template <bool B, typename T = void>
struct enable_if {};
template <typename T>
struct enable_if<true, T> {
  typedef T type;
};
template <typename A, typename B>
struct is_same {
  static constexpr bool value = false;
};
template <typename A>
struct is_same<A, A> {
  static constexpr bool value = true;
};

template <typename T, int N>
struct vec_storage;

template <typename T>
struct alignas(2 * sizeof(T)) vec_storage<T, 2> {
  union {
    T v[2];
    struct {
      T x, y;
    };
    struct {
      T r, g;
    };
  };
};

template <typename T>
struct alignas(4 * sizeof(T)) vec_storage<T, 3> {
  union {
    T v[4];
    struct {
      T x, y, z;
    };
    struct {
      T r, g, b;
    };
  };
};

template <typename T>
struct alignas(4 * sizeof(T)) vec_storage<T, 4> {
  union {
    T v[4];
    struct {
      T x, y, z, w;
    };
    struct {
      T r, g, b, a;
    };
  };
};

// The components of a constructor argument: a scalar gives one, a vec<U, M> M.
template <typename A>
struct components {
  static constexpr int value = 1;
};
template <typename U, int M>
struct vec;
template <typename U, int M>
struct components<vec<U, M>> {
  static constexpr int value = M;
};
template <typename... A>
struct total_components;
template <>
struct total_components<> {
  static constexpr int value = 0;
};
template <typename A, typename... R>
struct total_components<A, R...> {
  static constexpr int value = components<A>::value + total_components<R...>::value;
};

// One constructor and one assignment per address space of the source (no
// member function can be qualified by one): a copy converts implicitly,
// another element type explicitly.
#define MSL_VEC_FROM(space)                                                            \
  vec(const space vec& o) {                                                             \
    for (int i = 0; i < N; ++i) v[i] = o.v[i];                                          \
  }                                                                                     \
  vec& operator=(const space vec& o) {                                                  \
    for (int i = 0; i < N; ++i) v[i] = o.v[i];                                          \
    return *this;                                                                       \
  }                                                                                     \
  template <typename U, typename = typename enable_if<!is_same<U, T>::value>::type>     \
  explicit vec(const space vec<U, N>& o) {                                              \
    for (int i = 0; i < N; ++i) v[i] = T(o.v[i]);                                       \
  }

template <typename T, int N>
struct vec : vec_storage<T, N> {
  using vec_storage<T, N>::v;

  vec() = default;
  vec(const vec&) = default;
  vec& operator=(const vec&) = default;
  // Splat.
  vec(T s) {
    for (int i = 0; i < N; ++i) v[i] = s;
  }
  // Scalars and vectors whose components add up to N: float4(a, b, c, d), float4(float2, float2).
  template <typename... A, typename = typename enable_if<(sizeof...(A) > 1) && total_components<A...>::value == N>::type>
  vec(A... a) {
    int i = 0;
    const int unused[] = {(put(i, a), 0)...};
    (void)unused;
  }
  MSL_VEC_FROM(device)
  MSL_VEC_FROM(constant)
  MSL_VEC_FROM(threadgroup)
  template <typename U, typename = typename enable_if<!is_same<U, T>::value>::type>
  explicit vec(const vec<U, N>& o) {
    for (int i = 0; i < N; ++i) v[i] = T(o.v[i]);
  }

  T& operator[](int i) { return v[i]; }
  const T& operator[](int i) const { return v[i]; }

#define MSL_VEC_OP(op)                                                              \
  vec& operator op##=(vec o) {                                                      \
    for (int i = 0; i < N; ++i) v[i] = T(v[i] op o.v[i]);                           \
    return *this;                                                                   \
  }                                                                                 \
  friend vec operator op(vec a, vec b) { return a op##= b; }                        \
  friend vec operator op(vec a, T b) { return a op##= vec(b); }                     \
  friend vec operator op(T a, vec b) { return vec(a) op##= b; }
  MSL_VEC_OP(+)
  MSL_VEC_OP(-)
  MSL_VEC_OP(*)
  MSL_VEC_OP(/)
#undef MSL_VEC_OP
  friend vec operator-(vec a) { return vec(T(0)) - a; }

 private:
  void put(int& i, T s) { v[i++] = s; }
  template <typename U, int M>
  void put(int& i, vec<U, M> o) {
    for (int k = 0; k < M; ++k) v[i++] = T(o.v[k]);
  }
};
#undef MSL_VEC_FROM

static_assert(sizeof(vec<float, 3>) == 16, "MSL float3 takes 16 bytes");
static_assert(sizeof(vec<half, 4>) == 8, "MSL half4 takes 8 bytes");

} // namespace metal

#define MSL_VECTOR_TYPEDEFS(T)        \
  typedef metal::vec<T, 2> T##2;      \
  typedef metal::vec<T, 3> T##3;      \
  typedef metal::vec<T, 4> T##4;
MSL_VECTOR_TYPEDEFS(bool)
MSL_VECTOR_TYPEDEFS(char)
MSL_VECTOR_TYPEDEFS(uchar)
MSL_VECTOR_TYPEDEFS(short)
MSL_VECTOR_TYPEDEFS(ushort)
MSL_VECTOR_TYPEDEFS(int)
MSL_VECTOR_TYPEDEFS(uint)
MSL_VECTOR_TYPEDEFS(long)
MSL_VECTOR_TYPEDEFS(ulong)
MSL_VECTOR_TYPEDEFS(half)
MSL_VECTOR_TYPEDEFS(bfloat)
MSL_VECTOR_TYPEDEFS(float)
#undef MSL_VECTOR_TYPEDEFS

#include "msl_strict_stdlib.h"
