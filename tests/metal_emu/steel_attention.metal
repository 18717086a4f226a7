// MLX's steel attention kernel, from the installed wheel's headers (see
// mlx_kernels.py), instantiated as MLX's steel_attention.metal does: the proof
// that the harness's simdgroup matrices (multiply-accumulate and the
// thread_elements layout) are the ones MLX's kernels rely on.
// Host names: steel_attention_<dtype>_bq<BQ>_bk<BK>_bd<BD>_wm<WM>_wn<WN>.
#include <metal_stdlib>

#include "mlx/backend/metal/kernels/utils.h"
#include "mlx/backend/metal/kernels/steel/attn/kernels/steel_attention.h"

#define instantiate_attention(tname, type, bq, bk, bd, wm, wn)                                     \
  template [[host_name("steel_attention_" #tname "_bq" #bq "_bk" #bk "_bd" #bd "_wm" #wm "_wn" #wn)]] \
  [[kernel]] decltype(attention<type, bq, bk, bd, bd, wm, wn, type, float>)                        \
      attention<type, bq, bk, bd, bd, wm, wn, type, float>;

instantiate_attention(float32, float, 32, 16, 64, 4, 1)
instantiate_attention(float16, half, 32, 32, 64, 4, 1)
instantiate_attention(float16, half, 32, 32, 128, 4, 2)
