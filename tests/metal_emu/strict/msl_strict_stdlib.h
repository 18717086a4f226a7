// The metal_stdlib functions a kernel may call, declared with MSL's overloads
// only (a syntax check needs no body): the overload sets decide which calls
// resolve, so a call that is ambiguous in MSL (max(int, uint)) is ambiguous here.
#pragma once

namespace metal {

// Overloads of each scalar type and its vectors.
#define MSL_SCALAR_AND_VECTORS(M, T) M(T) M(T##2) M(T##3) M(T##4)
#define MSL_FLOATS(M) MSL_SCALAR_AND_VECTORS(M, float) MSL_SCALAR_AND_VECTORS(M, half)
#define MSL_INTEGERS(M)                                                                           \
  MSL_SCALAR_AND_VECTORS(M, char) MSL_SCALAR_AND_VECTORS(M, uchar) MSL_SCALAR_AND_VECTORS(M, short) \
  MSL_SCALAR_AND_VECTORS(M, ushort) MSL_SCALAR_AND_VECTORS(M, int) MSL_SCALAR_AND_VECTORS(M, uint)  \
  MSL_SCALAR_AND_VECTORS(M, long) MSL_SCALAR_AND_VECTORS(M, ulong)
// The types of the simdgroup functions (bfloat is not among them).
#define MSL_SIMD_TYPES(M)                                                                          \
  MSL_SCALAR_AND_VECTORS(M, float) MSL_SCALAR_AND_VECTORS(M, half) MSL_SCALAR_AND_VECTORS(M, short) \
  MSL_SCALAR_AND_VECTORS(M, ushort) MSL_SCALAR_AND_VECTORS(M, int) MSL_SCALAR_AND_VECTORS(M, uint)

#define MSL_UNARY(T) T exp(T); T exp2(T); T log(T); T log2(T); T sqrt(T); T rsqrt(T); T fabs(T); \
  T abs(T); T floor(T); T ceil(T); T trunc(T); T round(T); T tanh(T); T sin(T); T cos(T);
#define MSL_BINARY(T) T fmin(T, T); T fmax(T, T); T pow(T, T); T fmod(T, T);
#define MSL_TERNARY(T) T fma(T, T, T); T mix(T, T, T);
#define MSL_MIN_MAX(T) T min(T, T); T max(T, T); T clamp(T, T, T);
#define MSL_INTEGER_ONLY(T) T abs(T); T popcount(T);
MSL_FLOATS(MSL_UNARY)
MSL_FLOATS(MSL_BINARY)
MSL_FLOATS(MSL_TERNARY)
MSL_FLOATS(MSL_MIN_MAX)
MSL_INTEGERS(MSL_MIN_MAX)
MSL_INTEGERS(MSL_INTEGER_ONLY)
bool isnan(float);
bool isinf(float);
bool isfinite(float);
bool isnan(half);
bool isinf(half);
bool isfinite(half);

#define MSL_DOT(T) T dot(T##2, T##2); T dot(T##3, T##3); T dot(T##4, T##4);
MSL_DOT(float)
MSL_DOT(half)

// Fast and precise variants: float only.
#define MSL_FAST(T) T exp(T); T exp2(T); T log(T); T log2(T); T sqrt(T); T rsqrt(T); T tanh(T); \
  T fmin(T, T); T fmax(T, T); T max(T, T); T min(T, T); T clamp(T, T, T);
namespace fast {
MSL_SCALAR_AND_VECTORS(MSL_FAST, float)
}
namespace precise {
MSL_SCALAR_AND_VECTORS(MSL_FAST, float)
}

// Simdgroup functions: a reduction, or a lane's value by lane index or mask.
#define MSL_SIMD(T) T simd_sum(T); T simd_max(T); T simd_min(T); T simd_prod(T); \
  T simd_prefix_exclusive_sum(T); T simd_prefix_inclusive_sum(T); T simd_broadcast(T, ushort); \
  T simd_broadcast_first(T); T simd_shuffle(T, ushort); T simd_shuffle_xor(T, ushort); \
  T simd_shuffle_down(T, ushort); T simd_shuffle_up(T, ushort);
MSL_SIMD_TYPES(MSL_SIMD)
bool simd_is_first();
bool simd_all(bool);
bool simd_any(bool);

enum class mem_flags { mem_none = 0, mem_device = 1, mem_threadgroup = 2, mem_texture = 4 };
constexpr mem_flags operator|(mem_flags a, mem_flags b) {
  return mem_flags(int(a) | int(b));
}
void threadgroup_barrier(mem_flags);
void simdgroup_barrier(mem_flags);

// Simdgroup matrices (<metal_simdgroup_matrix>): 8x8 tiles, loaded from and stored to device or
// threadgroup memory; multiply-accumulate takes tiles of different element types (MLX's steel does).
template <typename T, int Cols, int Rows>
struct simdgroup_matrix {
  vec<T, 2>& thread_elements();
  const vec<T, 2>& thread_elements() const;
};
typedef simdgroup_matrix<float, 8, 8> simdgroup_float8x8;
typedef simdgroup_matrix<half, 8, 8> simdgroup_half8x8;
typedef simdgroup_matrix<bfloat, 8, 8> simdgroup_bfloat8x8;
template <typename T, int Cols = 8, int Rows = Cols>
simdgroup_matrix<T, Cols, Rows> make_filled_simdgroup_matrix(const T value);
#define MSL_SIMDGROUP_MATRIX_MEMORY(space)                                                              \
  template <typename T, int Cols, int Rows>                                                             \
  void simdgroup_load(simdgroup_matrix<T, Cols, Rows>& d, const space T* src, ulong elements_per_row = Cols, \
                      ulong2 matrix_origin = ulong2(0, 0), bool transpose_matrix = false);              \
  template <typename T, int Cols, int Rows>                                                             \
  void simdgroup_store(const simdgroup_matrix<T, Cols, Rows>& a, space T* dst, ulong elements_per_row = Cols, \
                       ulong2 matrix_origin = ulong2(0, 0), bool transpose_matrix = false);
MSL_SIMDGROUP_MATRIX_MEMORY(device)
MSL_SIMDGROUP_MATRIX_MEMORY(threadgroup)
#undef MSL_SIMDGROUP_MATRIX_MEMORY
template <typename TD, typename TA, typename TB, typename TC, int Cols, int Rows>
void simdgroup_multiply_accumulate(simdgroup_matrix<TD, Cols, Rows>& d, const simdgroup_matrix<TA, Cols, Rows>& a,
                                   const simdgroup_matrix<TB, Cols, Rows>& b, const simdgroup_matrix<TC, Cols, Rows>& c);
template <typename TD, typename TA, typename TB, int Cols, int Rows>
void simdgroup_multiply(simdgroup_matrix<TD, Cols, Rows>& d, const simdgroup_matrix<TA, Cols, Rows>& a,
                        const simdgroup_matrix<TB, Cols, Rows>& b);

#undef MSL_SCALAR_AND_VECTORS
#undef MSL_FLOATS
#undef MSL_INTEGERS
#undef MSL_SIMD_TYPES
#undef MSL_UNARY
#undef MSL_BINARY
#undef MSL_TERNARY
#undef MSL_MIN_MAX
#undef MSL_INTEGER_ONLY
#undef MSL_DOT
#undef MSL_FAST
#undef MSL_SIMD

// The limits a kernel reads at compile time (constexpr, so they have values).
template <typename T>
struct numeric_limits;
template <>
struct numeric_limits<float> {
  static constexpr float infinity() { return __builtin_inff(); }
  static constexpr float quiet_NaN() { return __builtin_nanf(""); }
  static constexpr float max() { return __FLT_MAX__; }
  static constexpr float min() { return __FLT_MIN__; }
  static constexpr float lowest() { return -__FLT_MAX__; }
};
template <>
struct numeric_limits<half> {
  static constexpr half infinity() { return half(__builtin_inff()); }
  static constexpr half max() { return half(65504.0f); }
  static constexpr half lowest() { return half(-65504.0f); }
};
template <>
struct numeric_limits<int> {
  static constexpr int max() { return __INT_MAX__; }
  static constexpr int min() { return -__INT_MAX__ - 1; }
  static constexpr int lowest() { return -__INT_MAX__ - 1; }
};
template <>
struct numeric_limits<uint> {
  static constexpr uint max() { return ~0u; }
  static constexpr uint min() { return 0u; }
  static constexpr uint lowest() { return 0u; }
};

} // namespace metal
