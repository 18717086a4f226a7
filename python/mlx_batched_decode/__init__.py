"""Padded, masked, batched decode attention for MLX.

``batched_decode_attention`` attends one new token per request over that
request's own number of cached keys, in one fused kernel (C++ on the CPU, Metal
on Apple GPUs), reading strided cache views in place.
"""

import mlx.core  # noqa: F401  registers MLX's types before the extension loads

from ._ext import batched_decode_attention, reference_attention

__all__ = ["batched_decode_attention", "reference_attention"]
