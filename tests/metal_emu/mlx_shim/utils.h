// Stand-in for MLX's kernels/utils.h in harness builds of MLX's steel kernels:
// the few definitions steel/attn and steel/gemm use. The original also pulls in
// bf16_math.h and complex.h, whose per-address-space overloads collapse into
// redefinitions once the harness erases address spaces.
#pragma once

#include <metal_stdlib>

#define METAL_FUNC inline

#define M_LOG2E_F 1.4426950408889634f
#define M_LN2_F 0.6931471805599453f

typedef metal::bfloat bfloat16_t;

/** MLX's Limits<T>: finite_min, the lowest finite value, is steel's "-inf" score mask. */
template <typename T>
struct Limits;
template <>
struct Limits<float> {
  static constexpr float finite_min = -metal::numeric_limits<float>::max();
};
