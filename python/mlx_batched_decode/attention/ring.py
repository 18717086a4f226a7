"""``RingSlotAttention``: the zero-copy path of a sliding-window layer whose cache is a ring.

New K/V are scattered into the layer's ``RingSlotKVCache`` at their ring slots, and
``batched_decode_attention`` reads the ring in place through the step's ``RingStep`` of that size
(logical lengths and ``ring_offset``, derived once per step for every layer of the size). The op
is looked up on ``mlx_batched_decode`` at each call, as in ``slot``.

Shapes use the dimension legend of the package docstring (``mlx_batched_decode.attention``);
R = ring positions per request.
"""

from __future__ import annotations

import mlx.core as mx

import mlx_batched_decode

from ..caches.context import BatchedDecodeContext
from ..caches.ring_kv_cache import RingSlotKVCache
from .base import AttendOptions, DecodeAttention


class RingSlotAttention(DecodeAttention):
    """The zero-copy path over rings of ``size`` positions: ``context.layer_caches[layer]`` is a
    ``RingSlotKVCache`` of that size, and every row attends within a window of at most
    ``size - L + 1`` keys (the ring holds no older one)."""

    def __init__(self, size: int):
        self.size = size

    def update(
        self, context: BatchedDecodeContext, layer: int, keys: mx.array, values: mx.array
    ) -> tuple[mx.array, mx.array]:
        """Write the new ``[B, H_kv, L, D]`` keys/values; return the ``[B, H_kv, min(max_len, R),
        D]`` views of the rings."""
        cache = context.layer_caches[layer]
        if not (isinstance(cache, RingSlotKVCache) and cache.size == self.size):
            raise TypeError(
                f"[RingSlotAttention] layer {layer} needs a RingSlotKVCache of {self.size} "
                f"positions, got {cache!r}"
            )
        return cache.update(keys, values, context)

    def _attend(self, context, queries, keys, values, options: AttendOptions) -> mx.array:
        """``queries [B, H_q, L, D]`` over the rings from ``update`` -> ``[B, H_q, L, D]``."""
        reach = self.size - context.max_query_len + 1
        if options.window is None or options.window > reach:
            raise ValueError(
                f"[RingSlotAttention] a ring of {self.size} positions serves "
                f"{context.max_query_len} new tokens per request within windows of at most "
                f"{reach} keys, got "
                f"window={options.window}"
            )
        ring = context.rings[self.size]
        return mlx_batched_decode.batched_decode_attention(
            queries,
            keys,
            values,
            ring.valid_lens,
            ring_offset=ring.ring_offset,
            **options._asdict(),
        )
