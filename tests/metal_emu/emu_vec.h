// MSL vector types vec<T, N>: .x .y .z .w, [i], element-wise arithmetic,
// splat and conversion constructors, MSL sizes (a 3-vector takes 4 slots).
#pragma once

#include <type_traits>

namespace metal {

template <typename T, int N>
struct vec_storage;

template <typename T>
struct alignas(2 * sizeof(T)) vec_storage<T, 2> {
  union {
    T v[2];
    struct {
      T x, y;
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
  };
};

template <typename T>
struct alignas(4 * sizeof(T)) vec_storage<T, 4> {
  union {
    T v[4];
    struct {
      T x, y, z, w;
    };
  };
};

template <typename T, int N>
struct vec : vec_storage<T, N> {
  using vec_storage<T, N>::v;

  vec() = default;
  vec(T s) {
    for (int i = 0; i < N; ++i) v[i] = s;
  }
  template <typename... A, typename = std::enable_if_t<sizeof...(A) == N && (N > 1)>>
  vec(A... a) {
    const T init[] = {T(a)...};
    for (int i = 0; i < N; ++i) v[i] = init[i];
  }
  template <typename U, typename = std::enable_if_t<!std::is_same_v<U, T>>>
  explicit vec(const vec<U, N>& o) {
    for (int i = 0; i < N; ++i) v[i] = T(o.v[i]);
  }

#if defined(__SANITIZE_THREAD__)
  // GCC's ThreadSanitizer does not check a call's aggregate result stored straight into
  // memory (`shared[i] = a * b` with operator* not inlined); an assignment of its own does.
  vec(const vec&) = default;
  vec& operator=(const vec& o) {
    for (int i = 0; i < N; ++i) v[i] = o.v[i];
    return *this;
  }
#endif

  T& operator[](int i) { return v[i]; }
  const T& operator[](int i) const { return v[i]; }

#define EMU_VEC_ASSIGN_OP(op)                                 \
  vec& operator op##=(const vec& o) {                         \
    for (int i = 0; i < N; ++i) v[i] = T(v[i] op o.v[i]);     \
    return *this;                                             \
  }                                                           \
  friend vec operator op(vec a, const vec& b) { return a op##= b; } \
  friend vec operator op(vec a, T b) { return a op##= vec(b); }     \
  friend vec operator op(T a, const vec& b) { return vec(a) op##= b; }
  EMU_VEC_ASSIGN_OP(+)
  EMU_VEC_ASSIGN_OP(-)
  EMU_VEC_ASSIGN_OP(*)
  EMU_VEC_ASSIGN_OP(/)
#undef EMU_VEC_ASSIGN_OP
};

template <typename T, int N>
T dot(const vec<T, N>& a, const vec<T, N>& b) {
  T s = T(0);
  for (int i = 0; i < N; ++i) s += a.v[i] * b.v[i];
  return s;
}

static_assert(sizeof(vec<float, 3>) == 16, "MSL float3 takes 16 bytes");
static_assert(sizeof(vec<float, 4>) == 16, "MSL float4 takes 16 bytes");

} // namespace metal
