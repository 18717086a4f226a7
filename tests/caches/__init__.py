"""``mlx_batched_decode.caches``: contexts, slot, quantized and paged caches, block budgets."""
