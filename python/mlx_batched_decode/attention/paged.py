"""The paged attention path: new keys/values scattered into block pools, ``paged_decode_attention``.

Dimension legend: B = requests in the step, L = new tokens per request, H_q = query heads,
H_kv = key/value heads, N = blocks per pool, D = head dimension.
"""

from __future__ import annotations

import mlx.core as mx

import mlx_batched_decode

from ..caches.context import BatchedDecodeContext
from ..caches.paged_kv_cache import PagedKVCache
from .base import AttendOptions, DecodeAttention


class PagedAttention(DecodeAttention):
    """``context`` has block tables (``blocks``) and its ``layer_caches[layer]`` is a
    ``PagedKVCache``: one scatter per pool writes every request's new tokens at the context's
    slots, and ``paged_decode_attention`` reads the pools through the context's block tables."""

    def update(
        self, context: BatchedDecodeContext, layer: int, keys: mx.array, values: mx.array
    ) -> tuple[mx.array, mx.array]:
        """Write the new ``[B, H_kv, L, D]`` keys/values; return the layer's pools
        ``[N, block_size, H_kv, D]``."""
        cache = context.layer_caches[layer]
        if not isinstance(cache, PagedKVCache) or context.blocks is None:
            raise TypeError(
                f"[PagedAttention] layer {layer} needs a PagedKVCache and a context with block "
                f"tables, got {type(cache).__name__} and tables={context.tables!r}"
            )
        return cache.write(layer, keys, values, context)

    def _attend(self, context, queries, keys, values, options: AttendOptions) -> mx.array:
        """``queries [B, H_q, L, D]`` over the pools from ``update`` -> ``[B, H_q, L, D]``."""
        return mlx_batched_decode.paged_decode_attention(
            queries, keys, values, context.blocks.block_tables, context.valid_lens,
            **options._asdict()
        )
