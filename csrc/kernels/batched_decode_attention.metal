// Instantiations of the batched decode attention kernels: dtype x head dim.
// Host names: batched_decode_attention_<dtype>_<D> and
// batched_decode_attention_reduce_<dtype>_<D> (see csrc/metal/launch_plan.h).
#include "batched_decode_attention.h"

#define instantiate_batched_decode_attention(tname, type, dim)          \
  template [[host_name("batched_decode_attention_" #tname "_" #dim)]]   \
  [[kernel]] decltype(batched_decode_attention<type, dim>)              \
      batched_decode_attention<type, dim>;                              \
  template [[host_name("batched_decode_attention_reduce_" #tname "_" #dim)]] \
  [[kernel]] decltype(batched_decode_attention_reduce<type, dim>)       \
      batched_decode_attention_reduce<type, dim>;

#define instantiate_batched_decode_attention_dims(tname, type)  \
  instantiate_batched_decode_attention(tname, type, 64)         \
  instantiate_batched_decode_attention(tname, type, 80)         \
  instantiate_batched_decode_attention(tname, type, 96)         \
  instantiate_batched_decode_attention(tname, type, 128)        \
  instantiate_batched_decode_attention(tname, type, 256)

instantiate_batched_decode_attention_dims(float16, half)
instantiate_batched_decode_attention_dims(bfloat16, bfloat)
instantiate_batched_decode_attention_dims(float32, float)
