// Arguments of the quantized decode attention kernel beyond BatchedDecodeParams,
// shared by the Metal kernel, the host launcher and the Linux emulation
// harness. Includes nothing, as batched_decode_attention_params.h.
#ifndef MLX_BATCHED_DECODE_QUANTIZED_PARAMS_H
#define MLX_BATCHED_DECODE_QUANTIZED_PARAMS_H

// Buffer indices of the quantized kernel past BatchedDecodeParams (10); the
// packed words of keys and values take the dense kernel's 1 and 2.
#define MBD_QUANT_KEY_SCALES 11
#define MBD_QUANT_KEY_BIASES 12
#define MBD_QUANT_VALUE_SCALES 13
#define MBD_QUANT_VALUE_BIASES 14
#define MBD_QUANT_PARAMS 15

namespace mlx_batched_decode {

// Strides in elements of the scales and biases [B, H_kv, T, D / group_size]
// of keys ([0]) and values ([1]): batch, head, position, group.
struct QuantizedDecodeParams {
  int64_t scales_stride[2][4];
  int64_t biases_stride[2][4];
  int group_size;   // 32, 64 or 128
  int scales_dtype; // of every scale and bias: 0 float16, 1 bfloat16, 2 float32
};

} // namespace mlx_batched_decode

#endif
