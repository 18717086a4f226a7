// Stand-in for MLX's steel/utils/type_traits.h in harness builds: the original
// specialises pointer_element once per address space, which the harness erases.
#pragma once

#include <metal_stdlib>

namespace metal {

template <typename T>
struct pointer_element {};

template <typename T>
struct pointer_element<T*> {
  using type = remove_cv_t<T>;
};

template <typename T>
using pointer_element_t = typename pointer_element<remove_cv_t<T>>::type;

} // namespace metal
