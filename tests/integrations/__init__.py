"""``mlx_batched_decode.integrations``: the mlx-lm plug-in, its server, tensor parallelism."""
