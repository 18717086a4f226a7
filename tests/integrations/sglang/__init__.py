"""``mlx_batched_decode.integrations.sglang``: the SGLang plug-in on SGLang's own MLX backend."""
