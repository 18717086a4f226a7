"""``mlx_batched_decode.decoding``: BatchedDecoder over mlx-lm models, speculative decoding."""
