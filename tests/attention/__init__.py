"""``mlx_batched_decode.attention``: the decode attention paths."""
