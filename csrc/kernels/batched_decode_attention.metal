// Instantiations of the batched decode attention kernels: dtype x head dims.
// Host names (csrc/metal/launch_plan.h picks one per call):
//   batched_decode_attention_<dtype>_<D>, batched_decode_attention_reduce_<dtype>_<D>:
//     fast paths, D = Dv fixed at compile time, vector loads (scalar ones for views
//     whose rows do not start on the vector width), for D in 32, 64, 80, 96,
//     112, 128, 160, 192, 256, 512;
//   batched_decode_attention_<dtype>_<D>_v<Dv> (and its reduce): fast paths of
//     values narrower than keys, (192, 128) and (576, 512) (MLA's latent);
//   batched_decode_attention_<dtype>_upto<N>, batched_decode_attention_reduce_<dtype>_upto<N>:
//     the generic path for every other (D, Dv), D in 1..576 and Dv in 1..512,
//     N the smallest of 32, 64, 128, 256, 512, 576 with max(D, Dv) <= N; D and
//     Dv read at run time, scalar loads.
//   quantized_batched_decode_attention_<dtype>_<D>_<bits>bit (and _<D>_v<Dv>_<bits>bit,
//     _upto<N>_<bits>bit): the same on mx.quantize triples of bits 4 or 8, for
//     the head dims that are multiples of 32 (the group sizes' multiple), with the reduce above;
//   ragged_decode_attention_<dtype>_<D> (and _<D>_v<Dv>, _upto<N>): the main
//     pass on one buffer per request, for every head dim above, with the reduce above.
// The fast dense and ragged kernels of D = Dv <= 128 (32, 64, 80, 96, 112, 128)
// also hold the tiled path (simdgroup matrices, packed queries of many rows),
// which function constant MBD_FC_TILED selects (csrc/metal/launch_plan.h, uses_tiles).
#include "batched_decode_attention.h"

#define instantiate_batched_decode_attention(tname, type, dim, vdim, suffix, generic) \
  template [[host_name("batched_decode_attention_" #tname "_" #suffix)]]              \
  [[kernel]] decltype(batched_decode_attention<type, dim, vdim, generic>)            \
      batched_decode_attention<type, dim, vdim, generic>;                            \
  template [[host_name("batched_decode_attention_reduce_" #tname "_" #suffix)]]       \
  [[kernel]] decltype(batched_decode_attention_reduce<type, dim, vdim, generic>)     \
      batched_decode_attention_reduce<type, dim, vdim, generic>;

#define instantiate_fast(tname, type, dim) \
  instantiate_batched_decode_attention(tname, type, dim, dim, dim, false)
#define instantiate_fast_pair(tname, type, dim, vdim) \
  instantiate_batched_decode_attention(tname, type, dim, vdim, dim##_v##vdim, false)
#define instantiate_generic(tname, type, dim) \
  instantiate_batched_decode_attention(tname, type, dim, dim, upto##dim, true)

#define instantiate_batched_decode_attention_dims(tname, type) \
  instantiate_fast(tname, type, 32)                            \
  instantiate_fast(tname, type, 64)                            \
  instantiate_fast(tname, type, 80)                            \
  instantiate_fast(tname, type, 96)                            \
  instantiate_fast(tname, type, 112)                           \
  instantiate_fast(tname, type, 128)                           \
  instantiate_fast(tname, type, 160)                           \
  instantiate_fast(tname, type, 192)                           \
  instantiate_fast(tname, type, 256)                           \
  instantiate_fast(tname, type, 512)                           \
  instantiate_fast_pair(tname, type, 192, 128)                 \
  instantiate_fast_pair(tname, type, 576, 512)                 \
  instantiate_generic(tname, type, 32)                         \
  instantiate_generic(tname, type, 64)                         \
  instantiate_generic(tname, type, 128)                        \
  instantiate_generic(tname, type, 256)                        \
  instantiate_generic(tname, type, 512)                        \
  instantiate_generic(tname, type, 576)

#define instantiate_quantized_kernel(tname, type, dim, vdim, suffix, generic, bits)                \
  template [[host_name("quantized_batched_decode_attention_" #tname "_" #suffix "_" #bits "bit")]] \
  [[kernel]] decltype(quantized_batched_decode_attention<type, dim, vdim, generic, bits>)           \
      quantized_batched_decode_attention<type, dim, vdim, generic, bits>;

#define instantiate_quantized_fast(tname, type, dim, bits) \
  instantiate_quantized_kernel(tname, type, dim, dim, dim, false, bits)
#define instantiate_quantized_fast_pair(tname, type, dim, vdim, bits) \
  instantiate_quantized_kernel(tname, type, dim, vdim, dim##_v##vdim, false, bits)
#define instantiate_quantized_generic(tname, type, dim, bits) \
  instantiate_quantized_kernel(tname, type, dim, dim, upto##dim, true, bits)

#define instantiate_quantized_dims_bits(tname, type, bits)     \
  instantiate_quantized_fast(tname, type, 32, bits)            \
  instantiate_quantized_fast(tname, type, 64, bits)            \
  instantiate_quantized_fast(tname, type, 96, bits)            \
  instantiate_quantized_fast(tname, type, 128, bits)           \
  instantiate_quantized_fast(tname, type, 160, bits)           \
  instantiate_quantized_fast(tname, type, 192, bits)           \
  instantiate_quantized_fast(tname, type, 256, bits)           \
  instantiate_quantized_fast(tname, type, 512, bits)           \
  instantiate_quantized_fast_pair(tname, type, 192, 128, bits) \
  instantiate_quantized_fast_pair(tname, type, 576, 512, bits) \
  instantiate_quantized_generic(tname, type, 64, bits)         \
  instantiate_quantized_generic(tname, type, 128, bits)        \
  instantiate_quantized_generic(tname, type, 256, bits)        \
  instantiate_quantized_generic(tname, type, 512, bits)        \
  instantiate_quantized_generic(tname, type, 576, bits)

#define instantiate_quantized_dims(tname, type)  \
  instantiate_quantized_dims_bits(tname, type, 4) \
  instantiate_quantized_dims_bits(tname, type, 8)

#define instantiate_ragged_kernel(tname, type, dim, vdim, suffix, generic)        \
  template [[host_name("ragged_decode_attention_" #tname "_" #suffix)]]          \
  [[kernel]] decltype(ragged_decode_attention<type, dim, vdim, generic>)        \
      ragged_decode_attention<type, dim, vdim, generic>;

#define instantiate_ragged_fast(tname, type, dim) \
  instantiate_ragged_kernel(tname, type, dim, dim, dim, false)
#define instantiate_ragged_fast_pair(tname, type, dim, vdim) \
  instantiate_ragged_kernel(tname, type, dim, vdim, dim##_v##vdim, false)
#define instantiate_ragged_generic(tname, type, dim) \
  instantiate_ragged_kernel(tname, type, dim, dim, upto##dim, true)

#define instantiate_ragged_dims(tname, type)   \
  instantiate_ragged_fast(tname, type, 32)     \
  instantiate_ragged_fast(tname, type, 64)     \
  instantiate_ragged_fast(tname, type, 80)     \
  instantiate_ragged_fast(tname, type, 96)     \
  instantiate_ragged_fast(tname, type, 112)    \
  instantiate_ragged_fast(tname, type, 128)    \
  instantiate_ragged_fast(tname, type, 160)    \
  instantiate_ragged_fast(tname, type, 192)    \
  instantiate_ragged_fast(tname, type, 256)    \
  instantiate_ragged_fast(tname, type, 512)    \
  instantiate_ragged_fast_pair(tname, type, 192, 128) \
  instantiate_ragged_fast_pair(tname, type, 576, 512) \
  instantiate_ragged_generic(tname, type, 32)  \
  instantiate_ragged_generic(tname, type, 64)  \
  instantiate_ragged_generic(tname, type, 128) \
  instantiate_ragged_generic(tname, type, 256) \
  instantiate_ragged_generic(tname, type, 512) \
  instantiate_ragged_generic(tname, type, 576)

// Every kernel, unless MBD_KERNELS names the ones to compile instead: the
// run-time library of one dtype and head dim (csrc/metal/kernel_library.h).
#ifdef MBD_KERNELS
MBD_KERNELS
#else
instantiate_batched_decode_attention_dims(float16, half)
instantiate_batched_decode_attention_dims(bfloat16, bfloat)
instantiate_batched_decode_attention_dims(float32, float)
instantiate_quantized_dims(float16, half)
instantiate_quantized_dims(bfloat16, bfloat)
instantiate_quantized_dims(float32, float)
instantiate_ragged_dims(float16, half)
instantiate_ragged_dims(bfloat16, bfloat)
instantiate_ragged_dims(float32, float)
#endif
