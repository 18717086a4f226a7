// MSL's <metal_type_traits> in namespace metal: the C++ ones, with
// remove_addrspace as the identity (the harness erases address spaces).
#pragma once

#include <type_traits>

namespace metal {

using std::bool_constant;
using std::conditional_t;
using std::enable_if_t;
using std::integral_constant;
using std::is_floating_point;
using std::is_floating_point_v;
using std::is_integral;
using std::is_integral_v;
using std::is_same;
using std::is_same_v;
using std::remove_cv_t;
using std::remove_reference_t;

template <typename T>
struct remove_addrspace {
  using type = T;
};
template <typename T>
using remove_addrspace_t = typename remove_addrspace<T>::type;

} // namespace metal
